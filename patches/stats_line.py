"""The engine's per-generation stats as the one line a node shows in its status and the log."""

from __future__ import annotations


def format_mtp(stats) -> str:
    """The MTP part of the stats line: the depth (with ``mtp="auto"``: the cycles run at each depth,
    plain tokens as depth 0, and why plain steps ran), acceptance overall and per draft position,
    the draft vocabulary where it was not every id."""
    overall = (f"acceptance {100.0 * (stats.acceptance_rate or 0.0):.1f}% "
               f"({stats.accepted}/{stats.drafted} drafts")
    per = [f"{100.0 * a:.0f}%" if a is not None else "-" for a in getattr(stats, "mtp_acceptance", None) or ()]
    while per and per[-1] == "-":
        per.pop()
    overall += f"; by position {' '.join(per)})" if len(per) > 1 else ")"
    notes = "".join(f"; {t}" for t in (getattr(stats, "mtp_off", None), getattr(stats, "draft_vocab", None)) if t)
    if not getattr(stats, "mtp_auto", False):
        return f"MTP depth {stats.mtp_depth}, {overall}{notes}"
    depths = " ".join(f"{k}x{n}" for k, n in sorted((getattr(stats, "mtp_depths", None) or {}).items(),
                                                       reverse=True))
    return f"MTP auto (depth x cycles, 0 x plain tokens: {depths}), {overall}{notes}"


def format_stats(label: str, stats, stop_reason=None) -> str:
    """The node's status and log line: tokens, steps, MTP, tok/s, prefill, attention, decode path."""
    if stats is None:
        return f"{label}: done"
    mtp = format_mtp(stats) if getattr(stats, "mtp_depth", 0) else "MTP off"
    stop = f", stop: {stop_reason}" if stop_reason else ""
    path = f"; {stats.decode_path}" if getattr(stats, "decode_path", "") else ""  # no Triton: how to get it
    return (f"{label}: {stats.tokens} tokens in {stats.steps} steps, {mtp}, {stats.tok_per_s:.2f} tok/s "
            f"(prefill {stats.prefill_s:.2f} s, decode {stats.decode_s:.2f} s, attention "
            f"{stats.attention_backend}){stop}{path}")
