"""Launch settings computed from a GPU's properties, for the launches no table names (``launch.py``).

Inputs are a ``capabilities.DeviceRecord`` (None: the CPU interpreter, no limits; picks as for a
132-SM Hopper GPU) and the launch's shape. What each pick rests on:

* GEMV tile (BLOCK_N, BLOCK_K, warps, stages[, K slices]): the shape rules measured on an H200 at
  the 9B launches (wide outputs take 64 columns, a DeltaNet layer's inputs and attention q/k/v take
  512-wide tiles in 4 K slices, outputs of at most 8192 columns 2 warps; an MTP verify's DeltaNet
  inputs the unsliced 128-wide 5-stage tile where a block may use 160 KB), then fitted to the
  block's shared memory by ``gemv_shared``'s estimate: fewer stages down to 3, then narrower K
  tiles down to 64, then 2 stages.
* 4-bit GEMV tile (``gemv4_config``): 256 weight columns per K tile (nvfp4: 128 where the
  output has 16384 columns or more), 64 output columns from 8192 outputs (nvfp4: from 16384),
  4 warps, 3 stages (nvfp4: 2), fitted to shared memory: wider K tiles spill the unpacked weights
  from registers, and stages barely matter (the unpacking arithmetic bounds the tile, not memory
  latency).
* 4-bit word tile (``gemv4w_config``, convrot_w4a4 on the FMA units): one warp, one stage (Triton
  pipelines no load that feeds no dot), vector loads of the words; 1-2 rows: 32 outputs x 256 columns
  up to 8192 outputs, 8 x 512 below 16384, 16 x 512 above (``benchmarks/tune.py``'s grid); 3-4 rows 8 x 256, 5-8
  rows 4 x 256 (the accumulators grow with the rows: wider tiles spill from registers under Triton
  3.9). Split-K (``gemv4w_split``):
  enough one-warp programs to keep the memory system busy, 16 per SM, a power of two up to 16 and
  at most one range per K tile (16 at the 9B's 4096-wide split products, as measured).
* 4-bit register tile (``gemv4m_config``, ``gemv4.py``'s ``_mma_reason`` decides where it runs), on
  compute capability 8.0+: convrot_w4a4 from ``MMA_ROWS`` rows (an MTP-2..5 verify), nvfp4 at every
  row count; 16 outputs a warp; split products in 4 K ranges from K 8192. convrot_w4a4: 256 columns a
  K step (128 from 16384 outputs), 8 warps where the programs and K ranges number under 2 per SM,
  else 4. nvfp4 (about 45 SASS instructions a 32-bit word against 19 in this tile): 256 columns, 8
  warps, 4 with K ranges. convrot_w4a4's decode rows keep the word tile, which beats this one at one
  row (``gemv4_tiles.py``).
* Split-K: a product whose programs are too few to keep the memory system busy (fewer than 4 per
  SM for 8-bit weights, 2 for 16-bit) cuts K into the largest power of two of ranges that reaches
  it, at most 8 and at most one range per K tile.
* Decode attention: about one program per SM over the grid; the largest K/V tile whose stages fit.
* DeltaNet step: whole heads for one unrotated row, else 4 value-column blocks (4 warps each).
* L2 prefetch: 8 MB of the next product's weight, at most a quarter of L2.

The measurements behind these rules are in ``benchmarks/CHANGELOG.md``.
"""

from __future__ import annotations

from .capabilities import DeviceRecord

HOPPER_SMS = 132  # the SM count picks assume where no GPU is known (the interpreter)
PREFETCH_BYTES = 8 << 20
ATTENTION_TILES = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 2), (16, 1))  # (BLOCK_N, stages), largest first


def gemv_shared(config: tuple[int, ...], weights: int, w_bytes: int, x_bytes: int) -> int:
    """Shared memory a GEMV launch needs, as Triton 3.9 allocates it (the most any supported Triton
    does: 3.6 lets a group's weights share some buffers): per weight of the group, ``stages - 1``
    buffers of a weight tile and x's 16-row tile; a K-sliced tile's buffers are shared by the group."""
    block_n, block_k, _, stages = config[:4]
    per = block_n * block_k * w_bytes + 16 * block_k * x_bytes
    sliced = len(config) > 4 and config[4] > 1
    return (1 if sliced else weights) * max(1, stages - 1) * per


def gemv4_shared(config: tuple[int, ...], weights: int, x_bytes: int = 2) -> int:
    """Shared memory a 4-bit GEMV launch needs (``gemv4.py``; BLOCK_K in weight columns): per weight
    of the group, ``stages - 1`` buffers of the packed tile (BLOCK_N * BLOCK_K / 2 bytes) and x's
    even and odd 16-row tiles."""
    block_n, block_k, _, stages = config[:4]
    return weights * max(1, stages - 1) * (block_n * block_k // 2 + 16 * block_k * x_bytes)


def gemv_config(n: int, k: int, quant: bool, rows: int, record: DeviceRecord | None, weights: int = 1,
                x_bytes: int = 2) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps, stages[, K slices]) for ``n`` output columns in all over width ``k``,
    ``rows`` rows, a group of ``weights`` weights, x of ``x_bytes`` bytes an element."""
    shared = None if record is None else record.shared
    config = _gemv_shape_pick(n, k, quant, rows, shared)
    if shared is None:
        return config
    w_bytes = 1 if quant else 2
    block_n, block_k, warps, stages = config[:4]
    slices = config[4] if len(config) > 4 else 1
    while gemv_shared((block_n, block_k, warps, stages, slices), weights, w_bytes, x_bytes) > shared:
        if stages > 3:
            stages -= 1
        elif block_k > 64:
            block_k //= 2
            slices = max(1, min(slices, block_k // 128))
        elif stages > 2:
            stages -= 1
        else:
            break
    return (block_n, block_k, warps, stages) + ((slices,) if slices > 1 else ())


def gemv4_config(n: int, k: int, rows: int, record: DeviceRecord | None, weights: int = 1,
                 x_bytes: int = 2, fmt: str = "convrot_w4a4") -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of a 4-bit GEMV (``gemv4.py``; BLOCK_K in weight columns)
    of ``fmt`` (``convrot_w4a4`` or ``nvfp4``): the rule in the module docstring, then fitted to the
    block's shared memory (``gemv4_shared``), fewer stages first, then narrower K tiles down to 64."""
    nv = fmt == "nvfp4"
    block_n = 64 if n >= (16384 if nv else 8192) else 32
    block_k = 128 if nv and n >= 16384 else 256
    block_k = min(block_k, max(64, 1 << max(0, k - 1).bit_length()))
    warps, stages = 4, 2 if nv else 3
    if record is None:
        return block_n, block_k, warps, stages
    while gemv4_shared((block_n, block_k, warps, stages), weights, x_bytes) > record.shared:
        if stages > 2:
            stages -= 1
        elif block_k > 64:
            block_k //= 2
        else:
            break
    return block_n, block_k, warps, stages


def _gemv_shape_pick(n: int, k: int, quant: bool, rows: int, shared: int | None) -> tuple[int, ...]:
    if quant:
        if n >= 16384:
            return 64, 256, 4, 4
        if 8192 < n < 16384 and k < 8192:
            if rows > 1 and n >= 11264 and (shared is None or shared >= 160 * 1024):
                return 32, 128, 4, 5
            return 32, 512, 4, 3, 4
        return (32, 256, 2, 4) if n <= 8192 else (32, 256, 4, 4)
    if n >= 65536:
        return 128, 128, 8, 4
    if n >= 16384:
        return 64, 256, 4, 4
    if 11264 <= n and k < 8192:
        return 128, 128, 8, 4
    if 8192 <= n and k < 8192:
        return 32, 128, 4, 5
    return 32, 256, 4, 4


def gemv4w_config(n: int, k: int, rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K in weight columns, warps, stages, 1: vector loads) of the 4-bit word tile (``gemv4w.py``) for
    ``n`` outputs over width ``k`` and ``rows`` rows: the rule in the module docstring (no shared
    memory: any GPU fits it)."""
    if rows <= 2:
        block_n, block_k = (32, 256) if n <= 8192 else (8, 512) if n < 16384 else (16, 512)
    else:
        block_n, block_k = (8 if rows <= 4 else 4), 256
    block_k = min(block_k, max(32, 1 << max(0, k - 1).bit_length()))
    return block_n, block_k, 1, 1, 1


#: rows of x from which the fallback runs 4-bit products on the register tile (``gemv4m_config``)
MMA_ROWS = 3


def gemv4_pick(n: int, k: int, rows: int, record: DeviceRecord | None,
               fmt: str = "convrot_w4a4") -> tuple[int, int, int, int, int]:
    """The 4-bit word / register tile config for a launch no table names (``fmt`` convrot_w4a4 or
    nvfp4): ``gemv4m_config`` on compute capability 8.0+ (the interpreter: as for Hopper) for nvfp4 at
    any row count and convrot_w4a4 from ``MMA_ROWS`` rows, else ``gemv4w_config``."""
    if (record is None or record.arch >= 80) and (fmt == "nvfp4" or rows >= MMA_ROWS):
        return gemv4m_config(n, k, record, fmt)
    return gemv4w_config(n, k, rows)


def gemv4m_config(n: int, k: int, record: DeviceRecord | None,
                  fmt: str = "convrot_w4a4") -> tuple[int, int, int, int, int]:
    """(16, BLOCK_K, warps, 1, 2) of the register tile (``gemv4m.py``; module docstring)."""
    if fmt == "nvfp4":
        return 16, 256, 4 if gemv4m_split(n, k) > 1 else 8, 1, 2
    block_k = 128 if n >= 16384 else 256
    sms = HOPPER_SMS if record is None else record.sms
    warps = 8 if -(-n // 16) * gemv4m_split(n, k) < 2 * sms else 4
    return 16, block_k, warps, 1, 2


def gemv4m_split(n: int, k: int) -> int:
    """K ranges of a register-tile product whose consumer sums the partials: 4 from K 8192, else 1."""
    return 4 if k >= 8192 else 1


def gemv4w_split(n: int, k: int, record: DeviceRecord | None, block_n: int, block_k: int) -> int:
    """K ranges of a word-tile product whose consumer sums the partials (module docstring)."""
    sms = HOPPER_SMS if record is None else record.sms
    want = 16 * sms / -(-n // block_n)
    split = 1
    while split * 2 <= min(want, 16, max(1, k // block_k)):
        split *= 2
    return split


def gemv_split(n: int, k: int, quant: bool, record: DeviceRecord | None, block_n: int = 32,
               block_k: int = 256) -> int:
    """K ranges for a ``[n, k]`` product whose consumer sums the partials: enough programs for the
    memory system (4 per SM with 8-bit weights, 2 with 16-bit), a power of two up to 8."""
    sms = HOPPER_SMS if record is None else record.sms
    programs = -(-n // block_n)
    want = (4 if quant else 2) * sms / programs
    split = 1
    while split * 2 <= min(want, 8, max(1, k // block_k)):
        split *= 2
    return split


def deltanet(dk: int, dv: int, rows: int, rotate: bool) -> tuple[int, int]:
    """(value-column blocks per head, warps): more programs hide the serial row chain of several
    rows or the rotated output's second kernel; 4 warps keep the state tile out of local memory."""
    if dv % 4 or dv // 4 < 16 or (rows == 1 and not rotate):
        return 1, 4
    return 4, 4


def attention_splits(record: DeviceRecord | None, programs: int) -> int:
    """Split count: about one program per SM over the whole grid (4 on the interpreter)."""
    if record is None:
        return 4
    return max(1, min(128, -(-record.sms // programs)))


def attention_tile(d: int, itemsize: int, block_m: int, record: DeviceRecord | None, start: int = 0) -> dict:
    """The largest (BLOCK_N, stages) from ``ATTENTION_TILES[start:]`` whose K and V stages fit the
    block's shared memory (an estimate above what Triton keeps); 8 warps for 32+ query rows."""
    smem = 1 << 30 if record is None else record.shared
    for block_n, stages in ATTENTION_TILES[start:]:
        if stages * 2 * block_n * d * itemsize + block_m * d * itemsize + 4096 <= smem:
            break
    return {"BLOCK_N": block_n, "num_stages": stages, "num_warps": 8 if block_m >= 32 else 4}


def prefetch_bytes(record: DeviceRecord | None) -> int:
    """8 MB of the next weight, at most a quarter of L2."""
    if record is None or record.l2 <= 0:
        return PREFETCH_BYTES
    return min(PREFETCH_BYTES, record.l2 // 4 // 128 * 128)
