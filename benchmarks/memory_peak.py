"""What is allocated at a CUDA memory peak, and by which code (torch's allocator history).

``PeakProbe`` records the caching allocator's alloc/free events around a block of work, then
replays them to find the moment the most bytes were live (counting only what the block itself
allocated; memory held before it, the weights, is not in the trace) and lists the allocations live
then, largest first, each with the innermost frames of its Python stack outside torch.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["PeakProbe", "live_at_peak"]


def _where(frames: list[dict], depth: int = 4) -> list[str]:
    """The innermost ``depth`` frames that are not torch's own, as ``file:line name``."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name or name.startswith("??") or not name.endswith(".py"):
            continue
        path = Path(name)
        out.append(f"{path.parent.name}/{path.name}:{f.get('line')} {f.get('name')}")
        if len(out) == depth:
            break
    return out


def live_at_peak(trace: list[dict], top: int = 8) -> dict:
    """From one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``):
    ``{"peak_bytes": the most bytes live at once, "live": [{"bytes", "where"}, ...], "by_site":
    [{"bytes", "count", "where"}, ...]}``: the ``top`` largest allocations live at that moment, and
    the ``top`` call sites holding the most bytes then."""
    def replay(stop: int | None):
        live: dict[int, tuple[int, list]] = {}
        total = peak = peak_at = 0
        for i, e in enumerate(trace[:stop]):
            action, addr = e.get("action"), e.get("addr")
            if action == "alloc":
                live[addr] = (e["size"], e.get("frames", []))
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif action == "free_completed" and addr in live:
                total -= live.pop(addr)[0]
        return live, peak, peak_at

    _, peak, peak_at = replay(None)
    at_peak, _, _ = replay(peak_at + 1)  # the live set right after the peak's allocation
    biggest = sorted(at_peak.values(), key=lambda v: -v[0])[:top]
    sites: dict[tuple, list] = {}
    for size, frames in at_peak.values():
        site = sites.setdefault(tuple(_where(frames)), [0, 0])
        site[0] += size
        site[1] += 1
    by_site = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_bytes": peak, "live": [{"bytes": size, "where": _where(frames)} for size, frames in biggest],
            "by_site": [{"bytes": b, "count": c, "where": list(w)} for w, (b, c) in by_site]}


class PeakProbe:
    """``with PeakProbe(on) as probe: ...`` then ``probe.result`` (``live_at_peak`` of the block, or
    {} when off or without CUDA)."""

    def __init__(self, on: bool = True, max_entries: int = 200_000):
        self.on = on and torch.cuda.is_available()
        self.max_entries, self.result = max_entries, {}

    def __enter__(self):
        if self.on:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            dev = torch.cuda.current_device()
            traces = snap.get("device_traces", [])
            self.result = live_at_peak(traces[dev] if dev < len(traces) else [])
        return False
