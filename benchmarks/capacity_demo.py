"""Decode-attention time against cache capacity on this machine: ours stays flat, masked grows.

Qwen3.5-9B attention shape (16 query / 4 kv heads, head_dim 256), 1,024 filled slots, one new
row. On CPU it compares the length-aware torch path with the capacity-bound "masked" path that
ComfyUI uses today; on a CUDA GPU it adds the Triton kernel (bf16).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels import decode_attention  # noqa: E402

CAPACITIES = (2048, 8192, 32768, 65536)


def _time_ms(fn, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(filled: int = 1024, capacities=CAPACITIES) -> list[dict]:
    """Print and return one row per capacity: milliseconds per call for each backend."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["triton", "masked"] if device.type == "cuda" else ["torch", "masked"]
    reps = 50 if device.type == "cuda" else 5
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 16, 1, 256, device=device, dtype=dtype, generator=gen)
    lengths = torch.tensor([filled], dtype=torch.int32, device=device)
    print(f"\ndecode attention, 9B shape, {filled} filled slots, {device.type} {dtype} "
          "(milliseconds per layer call; median)")
    print(f"{'capacity':>9} " + " ".join(f"{b:>9}" for b in backends))
    rows = []
    for cap in capacities:
        k = torch.randn(1, 4, cap, 256, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, 4, cap, 256, device=device, dtype=dtype, generator=gen)
        row = {"capacity": cap}
        for b in backends:
            row[b] = _time_ms(lambda b=b, k=k, v=v: decode_attention(q, k, v, lengths, backend=b), device, reps)
        rows.append(row)
        print(f"{cap:>9} " + " ".join(f"{row[b]:>9.3f}" for b in backends), flush=True)
        del k, v
    first, last = rows[0], rows[-1]
    for b in backends:
        print(f"{b}: x{last[b] / first[b]:.2f} from capacity {first['capacity']} to {last['capacity']}")
    return rows


if __name__ == "__main__":
    run()
