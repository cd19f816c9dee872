"""``comfy_e2e.py --accept P ...``: MTP off, every fixed depth 1..5 and ``mtp="auto"`` at chosen
acceptance rates, inside ComfyUI, on the model ``comfy_e2e`` loaded (GPU).

Each draft is replaced, after the MTP head ran, by ``benchmarks.draft_hook.acceptance_hook``'s: the
reference token at that position with probability P (decided once per position), else another
token. The reference is the MTP-off output of the same prompt with the same settings: greedy
(every weight random but decisive, ``benchmarks.decode_e2e.build_model``, so greedy repeats with a
large margin) and the prompt enhancer's text-to-image sampling (temperature 1, top-k 20, top-p
0.95, presence penalty 1.5) with the same seed, whose tokens are the reference's at every depth
(keyed draws); each row records the acceptance it really got. Rows per mode and P, interleaved: off,
depth 1..5, auto (its cost book warm from the earlier rows, as in a ComfyUI process that has
generated before), after one short untimed generation of each per mode (Triton compiles each
depth's kernels on first use) and one of auto with no draft kept (row ``accept-warmup``: it
leaves drafting and probes, so the probes' catch-up graphs exist); decode tok/s from the 8th
token (``TokenClock``). Each generation ends by itself at ``tokens`` tokens (``max_length``), so
the pack keeps its decode stack and CUDA graphs from row to row as from one ComfyUI run to the
next: a depth ``auto`` switches to is one an earlier row captured (a generation stopped by an
exception keeps no stack, and every switch would then capture graphs inside the timed window).
"""

from __future__ import annotations

import statistics

from benchmarks.draft_hook import acceptance_hook

KINDS = ("off", "1", "2", "3", "4", "5", "auto")
#: the untimed auto generation before the rows: long enough to leave drafting and probe once
WARM_PROBE_TOKENS = 96


def sweep(fmt: str, target, embeds, clock, *, ps, tokens: int, modes: dict, vocab: int,
          repeat: int = 1) -> list[dict]:
    """Rows ``{"format", "kind": "accept", "mode", "p", "mtp", "tok_s", "acceptance", "depths", "wall_s",
    "trace", "decode_path"}`` for every mode (name -> sampling keyword arguments of ``generate``), P
    and MTP setting, each mode's after one ``{"format", "kind": "accept-warmup", "mode", "probes",
    "depths"}`` (the untimed auto generation's shadow probes and depths). The engine is called as
    the patch calls it (``run_engine``'s binding hooks and execution dtype), with a callback that
    ticks ``clock`` and keeps the generation's stats."""
    from qwen35_fast.engine import generate
    from qwen35_fast.patches import comfy_bridge as bridge

    bind = dict(weight_cast=bridge.comfy_weight_cast, weights=bridge.WEIGHTS, stop_tokens=[],
                execution_dtype=bridge.default_execution_dtype(embeds.device))
    rows = []
    for mode, kw in modes.items():
        reference = generate(target.transformer, embeds, max_length=tokens + 16, mtp="off", **bind, **kw).tokens
        for mtp in KINDS[1:]:  # untimed: each depth's kernels compiled (comfy_e2e reports first use)
            generate(target.transformer, embeds, max_length=48, mtp=mtp,
                     mtp_draft=acceptance_hook(reference, 0.5, vocab=vocab, seed=1), **bind, **kw)
        # untimed: auto with no draft kept leaves for plain segments and probes them, so the probes'
        # catch-up graphs are captured before a timed row needs them (a process does this once)
        warm = generate(target.transformer, embeds, max_length=WARM_PROBE_TOKENS, mtp="auto",
                        mtp_draft=acceptance_hook(reference, 0.0, vocab=vocab, seed=1), **bind, **kw)
        rows.append({"format": fmt, "kind": "accept-warmup", "mode": mode, "probes": warm.stats.mtp_trace["probes"],
                     "depths": {str(k): v for k, v in warm.stats.mtp_depths.items()}})
        for p in ps:
            for _ in range(repeat):
                for mtp in KINDS:
                    hook = acceptance_hook(reference, p, vocab=vocab, seed=7) if mtp != "off" else "argmax"
                    seen = {}

                    def tick(all_tokens, new, stats, seen=seen):
                        seen["stats"] = stats
                        clock.tick(len(all_tokens))

                    tok_s = clock.run(lambda m=mtp, h=hook, cb=tick: generate(
                        target.transformer, embeds, max_length=tokens, mtp=m, mtp_draft=h, callback=cb,
                        **bind, **kw), tokens, stop=False)
                    stats = seen["stats"]
                    row = {"format": fmt, "kind": "accept", "mode": mode, "p": p, "mtp": mtp, "tok_s": tok_s,
                           "acceptance": stats.acceptance_rate,
                           "depths": {str(k): v for k, v in stats.mtp_depths.items()},
                           "wall_s": stats.decode_s, "trace": stats.mtp_trace, "decode_path": stats.decode_path}
                    rows.append(row)
                    print(f"{fmt:>5} {mode:>7} P={p:.1f} mtp={mtp:>4}: {tok_s:8.1f} tok/s, acceptance "
                          f"{100 * row['acceptance']:5.1f}% {row['depths'] or ''}", flush=True)
                    if row["trace"]:
                        tr = row["trace"]
                        moves = [(m["at"], m["from"], m["to"]) for m in tr["switches"]]
                        print(f"      trace: decode {row['wall_s']:.3f} s, wall {tr['wall_s']}, probes {tr['probes']} "
                              f"({tr['probe_s']} s), a {tr['a']}, cost ms {tr['cost_ms']}, timed {tr['timed']}, "
                              f"ready {tr['ready']}, switches {moves}",
                              flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per format, mode and P, the median tok/s of each setting, auto's ratio to the best
    fixed setting and to off, and the depths auto ran."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    depths: dict[tuple, dict] = {}
    for r in rows:
        if r.get("kind") != "accept":
            continue
        key = (r["format"], r["mode"], r["p"])
        groups.setdefault(key, {}).setdefault(r["mtp"], []).append(r["tok_s"])
        if r["mtp"] == "auto":
            depths[key] = r["depths"]
    head = "| file | sampling | P | " + " | ".join(KINDS) + " | auto / best | auto / off | auto's depths |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (fmt, mode, p), by in sorted(groups.items()):
        med = {k: statistics.median(v) for k, v in by.items()}
        best = max(v for k, v in med.items() if k != "auto")
        auto = med.get("auto", float("nan"))
        cells = " | ".join(f"{med[k]:.0f}" if k in med else "-" for k in KINDS)
        hist = " ".join(f"{k}x{n}" for k, n in sorted(depths.get((fmt, mode, p), {}).items(), reverse=True))
        lines.append(f"| {fmt} | {mode} | {p:.1f} | {cells} | {auto / best:.2f} | {auto / med['off']:.2f} | {hist} |")
    return "\n".join(lines)
