"""The engine's per-generation stats as a node's status lines and as the log line.

A node shows the first lines of its status: what the user must act on comes first (``notes``: a
warning, "MTP off: no head ...", a suspect head), then ``summary`` (tokens, tok/s, MTP depth and
acceptance: one short line), then ``details`` (steps, MTP per depth and position, timings, attention,
how it stopped, the decode path). ``short_name`` keeps file names in those lines short.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SUFFIXES = (".safetensors", ".sft")


def short_name(path: str, width: int = 32) -> str:
    """``path``'s file name without its folder and ``.safetensors``, cut in the middle ("..." standing
    for the cut) to at most ``width`` characters."""
    name = os.path.basename(str(path))
    for suffix in SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    if len(name) <= width:
        return name
    head = (width - 3) * 3 // 8  # more of the end, where a file's format is named
    return f"{name[:head]}...{name[len(name) - (width - 3 - head):]}"


def _mtp_short(stats) -> str:
    """``MTP off`` / ``MTP depth k, acceptance a%`` / ``MTP auto (mostly k), acceptance a%``."""
    if not getattr(stats, "mtp_depth", 0):
        return "MTP off"
    acceptance = f"acceptance {100.0 * (stats.acceptance_rate or 0.0):.0f}%"
    if not getattr(stats, "mtp_auto", False):
        return f"MTP depth {stats.mtp_depth}, {acceptance}"
    cycles = {k: n for k, n in (getattr(stats, "mtp_depths", None) or {}).items() if k}
    if not cycles:
        return f"MTP auto (plain steps), {acceptance}"
    return f"MTP auto (mostly {max(cycles, key=lambda k: (cycles[k], k))}), {acceptance}"


def summary(stats) -> str:
    """One short line: tokens, tok/s, the MTP depth and the share of drafts accepted; with a thinking
    budget, the thinking tokens and whether the budget ended them."""
    line = f"{stats.tokens} tokens, {stats.tok_per_s:.1f} tok/s, {_mtp_short(stats)}"
    thought = getattr(stats, "thinking_tokens", None)
    if thought is not None:
        line += f"; thinking {thought} tokens" + (", ended by the budget" if getattr(stats, "thinking_cut", False)
                                                   else "")
    return line


def format_mtp(stats) -> str:
    """The MTP details: the depth (with ``mtp="auto"``: the cycles run at each depth, plain tokens as
    depth 0, and why plain steps ran), acceptance overall and per draft position, the draft vocabulary
    where it was not every id."""
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


def details(stats, stop_reason=None) -> str:
    """Steps, MTP details, prefill / decode seconds, attention backend, why it stopped, decode path."""
    mtp = f"; {format_mtp(stats)}" if getattr(stats, "mtp_depth", 0) else ""
    stop = f", stop: {stop_reason}" if stop_reason else ""
    path = f"; {stats.decode_path}" if getattr(stats, "decode_path", "") else ""  # no Triton: how to get it
    return (f"{stats.steps} steps{mtp}; prefill {stats.prefill_s:.2f} s, decode {stats.decode_s:.2f} s, "
            f"attention {stats.attention_backend}{stop}{path}")


def status_lines(stats, stop_reason=None, notes=()) -> list[str]:
    """A node's status after a generation: ``notes`` (each one line, to act on) first, then the
    summary, then the details; ``stats`` None gives ``notes`` and "done"."""
    if stats is None:
        return [*notes, "done"]
    return [*notes, summary(stats), details(stats, stop_reason)]


def format_stats(label: str, stats, stop_reason=None) -> str:
    """``label: summary`` on a first line, the details on a second (the log joins them)."""
    if stats is None:
        return f"{label}: done"
    return f"{label}: {summary(stats)}\n{details(stats, stop_reason)}"


def log_line(label: str, stats, stop_reason=None) -> str:
    """``format_stats`` as one log line."""
    return format_stats(label, stats, stop_reason).replace("\n", "; ")


#: A head fetched by range reads whose drafts are accepted at most this often at the first draft
#: position, over at least SUSPECT_MIN_DRAFTS drafts of one generation, is said to be suspect.
SUSPECT_ACCEPTANCE = 0.05
SUSPECT_MIN_DRAFTS = 8
_suspects_said: set[str] = set()


def suspect_head_note(info: Mapping, stats) -> str | None:
    """One line for a generation whose MTP drafts were nearly never accepted when the CLIP's head was
    fetched by range reads (``info["fetched_head"]``: its path, recorded by the loader node for its
    ``download (...)`` choice): the head may be wrong, delete it and run again to fetch it anew. Said
    once per file (as fetched) and process; None for a head the user supplied, for accepted drafts and
    for fewer than SUSPECT_MIN_DRAFTS drafts."""
    path = info.get("fetched_head") if isinstance(info, Mapping) else None
    if not path or stats is None or not getattr(stats, "mtp_depth", 0):
        return None
    try:
        said = f"{path}@{os.stat(path).st_mtime_ns}"  # a file fetched anew may be said again
    except OSError:
        said = str(path)
    if said in _suspects_said:
        return None
    if (getattr(stats, "drafted", 0) or 0) < SUSPECT_MIN_DRAFTS:
        return None
    first = (getattr(stats, "mtp_acceptance", None) or [None])[0]
    rate = stats.acceptance_rate if first is None else first
    if rate is None or rate > SUSPECT_ACCEPTANCE:
        return None
    _suspects_said.add(said)
    folder = os.path.basename(os.path.dirname(str(path))) or "its folder"
    return (f"MTP head may be wrong ({100 * rate:.0f}% of drafts kept): delete {os.path.basename(str(path))} "
            f"from {folder} and run again to fetch it anew.")
