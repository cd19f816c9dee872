"""The launch picks as code, frozen as they were before the launch tables (``kernels/launch.py``).

The migration oracle: ``test_launch.py`` checks that the H100 and H200 tables (with the computed
fallback for what they leave out) give exactly these picks for every launch of the 9B decode step.
Copied from the pick functions of ``kernels/gemv.py`` (``_default_config``, ``split_k``),
``kernels/deltanet_step.py`` (``_config``) and ``kernels/attention_triton.py`` (``default_splits``,
``default_config``), without their environment overrides, with Triton 3.3+ (K-sliced tiles).
"""

from __future__ import annotations

PREFETCH_BYTES = MIXER_PREFETCH_BYTES = 8192 << 10


def gemv_config(n: int, k: int, quant: bool, rows: int, shared: int | None) -> tuple[int, ...]:
    if quant:
        if n >= 16384:
            return 64, 256, 4, 4
        if 8192 < n < 16384 and k < 8192:
            if rows > 1 and n >= 11264 and (shared is None or shared >= 160 * 1024):
                return 32, 128, 4, 5
            return 32, 512, 4, 3, 4
        if n <= 8192:
            return 32, 256, 2, 4
        return 32, 256, 4, 4
    if n >= 65536:
        return 128, 128, 8, 4
    if n >= 16384:
        return 64, 256, 4, 4
    if 11264 <= n and k < 8192:
        return 128, 128, 8, 4
    if 8192 <= n and k < 8192:
        return 32, 128, 4, 5
    return 32, 256, 4, 4


def gemv_split(n: int, k: int, quant: bool) -> int:
    if n > 8192:
        return 1
    return 4 if quant else 2


def deltanet(dk: int, dv: int, rows: int, rotate: bool) -> tuple[int, int]:
    if dv % 4 or dv // 4 < 16:
        return 1, 4
    if rows == 1 and not rotate:
        return 1, 4
    return 4, 4


TILES = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 2), (16, 1))


def attention_splits(sms: int | None, programs: int) -> int:
    if sms is None:
        return 4
    return max(1, min(128, -(-sms // programs)))


def attention_tile(d: int, itemsize: int, block_m: int, smem_limit: int) -> dict:
    for block_n, stages in TILES:
        need = stages * 2 * block_n * d * itemsize + block_m * d * itemsize + 4096
        if need <= smem_limit:
            break
    return {"BLOCK_N": block_n, "num_stages": stages, "num_warps": 8 if block_m >= 32 else 4}
