"""Where a decode token's GPU time goes in a real generation (CUDA graphs on): a kernel timeline.

``token_timeline(generate_n, short, long)`` traces two generations with the torch profiler's CUDA
activity (every kernel of every graph replay, with its start and end on the GPU clock) and takes
their difference over ``long - short`` tokens, so the prefill, the captures and the first steps
cancel out. Per token:

- ``busy_us``: the union of kernel intervals (kernels that overlap under programmatic dependent
  launch count once); idle time between kernels, split at ``host_gap_us`` into gaps inside a step
  (launch and drain) and gaps between steps (the host: sampling, the next replay); gaps over
  ``one_off_us`` (a graph capture, the prefill's host work) are left out of both; ``long_gaps``:
  the gaps between steps by the kernels before and after them (where the host holds the GPU up);
- per kernel name: launches and total / mean duration (a kernel launched early under PDL counts
  its waiting time too, so compare durations with plain launches);
- ``step``: one step's kernels in GPU order with their start times, to see what runs between
  graph replays and where the step waits.

CUPTI instruments every graph node, so traced steps run somewhat slower than untraced ones: read the
split, not the absolute time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def _kernels(fn) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every GPU kernel ``fn()`` ran, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out)


def _stats(kernels, host_gap_us: float, one_off_us: float) -> dict:
    busy = short = long = 0.0
    names: dict[str, list[float]] = {}
    where: dict[tuple[str, str], list[float]] = {}  # (kernel before, kernel after) of the long gaps
    end = last = None
    for s, e, name in kernels:
        k = names.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += e - s
        if end is None or s >= end:
            if end is not None:
                gap = s - end
                if gap <= host_gap_us:
                    short += gap
                elif gap <= one_off_us:
                    long += gap
                    w = where.setdefault((last[:60], name[:60]), [0, 0.0])
                    w[0] += 1
                    w[1] += gap
            busy += e - s
            end, last = e, name
        elif e > end:
            busy += e - end
            end, last = e, name
    return {"busy": busy, "short": short, "long": long, "names": names, "where": where}


def _one_step(kernels, markers: tuple[str, ...] = ("_argmax_final_kernel", "ArgMax"), steps: int = 1) -> list[dict]:
    """The kernels between consecutive marker kernels in the middle of a trace (MTP off: the greedy
    draw ends each step; ``kernels/argmax.py``'s in the step itself, torch's after it), ``steps``
    such segments in a row (forced MTP-3: 4, a draft's and the verify's draws each end one), in GPU
    order: name, start after the first segment's first marker's end, duration."""
    at = [i for i, (_s, _e, name) in enumerate(kernels) if any(m in name for m in markers)]
    if len(at) < 2 + steps:
        return []
    i, j = at[len(at) // 2 - 1], at[len(at) // 2 - 1 + steps]
    t0 = kernels[i][1]
    return [{"kernel": name[:70], "start_us": round(s - t0, 2), "us": round(e - s, 2)}
            for s, e, name in kernels[i + 1:j + 1]]


def token_timeline(generate_n, short: int = 40, long: int = 140, host_gap_us: float = 20.0,
                   one_off_us: float = 5000.0, top: int = 30, steps: int = 1) -> dict:
    """``generate_n(n)`` runs a generation of n tokens; returns the per-token split (module docstring)
    and ``step``: ``steps`` steps' kernels in order (``_one_step``)."""
    a = _stats(_kernels(lambda: generate_n(short)), host_gap_us, one_off_us)
    trace = _kernels(lambda: generate_n(long))
    b = _stats(trace, host_gap_us, one_off_us)
    n = long - short
    per = {}
    for name, (count, total) in b["names"].items():
        c0, t0 = a["names"].get(name, (0, 0.0))
        if count - c0 > 0:
            per[name] = ((count - c0) / n, (total - t0) / n)
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
    gaps = []
    for pair, (count, total) in b["where"].items():
        c0, t0 = a["where"].get(pair, (0, 0.0))
        if count - c0 > 0 and total - t0 > 0:
            gaps.append({"before": pair[0], "after": pair[1], "per_token": (count - c0) / n,
                         "us_per_token": (total - t0) / n})
    gaps.sort(key=lambda g: -g["us_per_token"])
    return {"tokens": n, "busy_us": (b["busy"] - a["busy"]) / n,
            "gap_in_step_us": (b["short"] - a["short"]) / n, "gap_between_steps_us": (b["long"] - a["long"]) / n,
            "launches": sum(c for c, _t in per.values()), "kernel_us": sum(t for _c, t in per.values()),
            "host_gap_us": host_gap_us,
            "top": [{"kernel": k[:90], "per_token": c, "us_per_token": t, "mean_us": t / c if c else 0.0}
                    for k, (c, t) in ranked[:top]], "long_gaps": gaps[:12], "step": _one_step(trace, steps=steps)}


def print_timeline(label: str, t: dict) -> None:
    """The table ``token_timeline`` returns, for a benchmark's log."""
    print(f"{label}: per token {t['busy_us']:.0f} us busy, {t['gap_in_step_us']:.0f} us gaps inside steps "
          f"(<= {t['host_gap_us']:.0f} us each), {t['gap_between_steps_us']:.0f} us between steps; "
          f"{t['launches']:.0f} launches, {t['kernel_us']:.0f} us of kernel durations", flush=True)
    for k in t["top"]:
        print(f"      {k['us_per_token']:8.1f} us  x{k['per_token']:5.1f}  mean {k['mean_us']:6.2f}  {k['kernel']}",
              flush=True)
    print("    gaps between steps, by the kernels either side:", flush=True)
    for g in t.get("long_gaps", []):
        print(f"      {g['us_per_token']:8.1f} us  x{g['per_token']:5.2f}  {g['before']}  ->  {g['after']}", flush=True)
