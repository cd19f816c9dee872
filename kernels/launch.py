"""Launch settings of the decode kernels: data per GPU, with a fallback computed for any other.

One question per kernel, answered in this order:
1. an explicit argument of the kernel call (tests, sweeps) - the caller's, never looked up here;
2. a table pinned by ``pinned(*paths)`` (``benchmarks/comfy_e2e.py --variants``, ``benchmarks/tune.py``);
3. the table for this GPU: ``kernels/tuned/*.json`` and the folder ``QWEN35_FAST_TUNED_DIR`` names
   (read once), the table whose ``device`` is this GPU's name, else the one of the same
   architecture with the nearest SM count;
4. ``fallback.py``'s picks computed from the device's properties (``capabilities.DeviceRecord``).
An entry gives some fields; the others come from the next source down, field by field.

A table (JSON): ``{"device": "NVIDIA H200", "arch": 90, "sms": 132, "provenance": {...},
"launches": {KERNEL: {KEY: {FIELD: VALUE}}}}``, KEY ``"<kind> <shape> @<rows>"`` with rows a row
count or ``*`` (any; an exact count first):

=============  ===================  ==========  ==============================================
kernel         kind                 shape       fields
=============  ===================  ==========  ==============================================
``gemv``       ``quant`` / float    ``NxK``     ``config`` [BLOCK_N, BLOCK_K, warps, stages(,
               / ``w4a4`` /                     K slices)], ``split`` (K ranges, split-K); ``w4a4``
               ``nvfp4``                        / ``nvfp4``: the word tile (fifth value 1: vector
                                                loads; 2: the register tile ``gemv4m.py``,
                                                BLOCK_N 16)
``deltanet``   ``rotate`` / plain   ``DKxDV``   ``blocks`` (value-column blocks), ``warps``
``attention``  ``d<D>``             ``g<G>``    ``splits``, ``BLOCK_N``, ``num_stages``,
                                                ``num_warps``
``prefetch``   ``l2``               ``*``       ``bytes``, ``mixer_bytes`` (``@*``)
=============  ===================  ==========  ==============================================

N is a grouped launch's columns in all (12352 for a 9B DeltaNet layer's four inputs); G the query
heads per kv head; rows the new rows per sequence (decode 1, an MTP-k verify k + 1). ``provenance`` says which
GPU, Triton, date and result files chose the values.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from pathlib import Path

from . import fallback
from .capabilities import DeviceRecord, device_record

log = logging.getLogger(__name__)

#: The folder of the tables that ship with the pack.
TUNED = Path(__file__).resolve().parent / "tuned"
#: A folder of more tables (read once, at the first lookup); its tables come before the shipped ones.
TUNED_DIR_ENV = "QWEN35_FAST_TUNED_DIR"


class TableError(ValueError):
    """A table file that cannot be read, named with the reason."""


def _pow2(lo: int, hi: int):
    return lambda v: isinstance(v, int) and lo <= v <= hi and not v & (v - 1), f"a power of two {lo}..{hi}"


def _between(lo: int, hi: int):
    return lambda v: isinstance(v, int) and lo <= v <= hi, f"a whole number {lo}..{hi}"


def _gemv_config(v) -> bool:
    pow2 = _pow2(16, 1024)[0]
    return (isinstance(v, list) and len(v) in (4, 5) and all(isinstance(x, int) for x in v)
            and _pow2(1, 1024)[0](v[0]) and pow2(v[1]) and _pow2(1, 16)[0](v[2]) and 1 <= v[3] <= 8
            and (len(v) == 4 or v[4] == 0 or _pow2(1, max(1, v[1] // 16))[0](v[4])))


#: kernel -> field -> (check, what it must be)
FIELDS = {
    "gemv": {"config": (_gemv_config, "[BLOCK_N (a power of two 1..1024), BLOCK_K (a power of two 16..1024), warps "
                                      "(a power of two 1..16), stages 1..8(, K slices: a power of two up to BLOCK_K "
                                      "/ 16; 4-bit: 0 or 1, vector loads, or 2, the register tile)]"),
             "split": _between(1, 64)},
    "deltanet": {"blocks": _pow2(1, 16), "warps": _pow2(1, 16)},
    "attention": {"splits": _between(1, 128), "BLOCK_N": _pow2(16, 256), "num_stages": _between(1, 8),
                  "num_warps": _pow2(1, 16)},
    "prefetch": {"bytes": _between(0, 1 << 40), "mixer_bytes": _between(0, 1 << 40)},
}


def read_table(path: str | os.PathLike) -> dict:
    """The table in ``path``, checked: a JSON object with ``launches`` holding only known kernels,
    keys ``"<kind> <shape> @<rows>"`` and objects of fields. TableError names the file and the fix."""
    path = Path(path)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TableError(f"launch table {path}: cannot read it ({exc})") from None
    launches = table.get("launches") if isinstance(table, dict) else None
    if not isinstance(launches, dict):
        raise TableError(f"launch table {path}: no \"launches\" object (see kernels/launch.py for the format)")
    for kernel, entries in launches.items():
        if kernel not in FIELDS or not isinstance(entries, dict):
            raise TableError(f"launch table {path}: unknown kernel {kernel!r} (one of {', '.join(FIELDS)})")
        for key, fields in entries.items():
            parts = key.split(" ")
            if len(parts) != 3 or not parts[2].startswith("@") or not isinstance(fields, dict):
                raise TableError(f"launch table {path}: {kernel} entry {key!r} is not '<kind> <shape> @<rows>' "
                                 "with an object of fields")
            for field, value in fields.items():
                check, what = FIELDS[kernel].get(field, (lambda v: False, f"one of {', '.join(FIELDS[kernel])}"))
                if not check(value):
                    raise TableError(f"launch table {path}: {kernel} entry {key!r}: {field} = {value!r} must be "
                                     f"{what}")
    table["path"] = str(path)
    return table


_PINNED: list[dict] = []  # pinned() tables, first wins
_CHOSEN: dict[DeviceRecord, dict | None] = {}
_ANSWERS: dict[tuple, dict] = {}


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict, ...]:
    """Every table found (the extra folder's first), read once; a bad one is skipped and said."""
    tables = []
    folders = [Path(os.environ[TUNED_DIR_ENV])] if os.environ.get(TUNED_DIR_ENV) else []
    for folder in folders + [TUNED]:
        for path in sorted(folder.glob("*.json")):
            try:
                tables.append(read_table(path))
            except TableError as exc:
                log.warning("%s; it is skipped (fix or delete the file)", exc)
    return tuple(tables)


def table_for(record: DeviceRecord | None) -> dict | None:
    """The table this GPU uses: the one named for it, else the same architecture's with the nearest
    SM count; None for none (or no GPU)."""
    if record is None:
        return None
    if record not in _CHOSEN:
        tables = _tables()
        mine = [t for t in tables if t.get("device") == record.name]
        if not mine:
            same = [t for t in tables if t.get("arch") == record.arch]
            mine = sorted(same, key=lambda t: abs(int(t.get("sms", 0)) - record.sms))
        _CHOSEN[record] = mine[0] if mine else None
    return _CHOSEN[record]


@contextlib.contextmanager
def pinned(*paths: str | os.PathLike):
    """Within the block, the tables in ``paths`` come before every other (first wins): a variant of
    a benchmark or a sweep's candidate, in one process. TableError before anything changes."""
    tables = [read_table(p) for p in paths]
    saved = list(_PINNED)
    _PINNED[:0] = tables
    _ANSWERS.clear()
    try:
        yield
    finally:
        _PINNED[:] = saved
        _ANSWERS.clear()


def _fields(table: dict, kernel: str, kind: str, shape: str, rows) -> dict:
    entries = table["launches"].get(kernel, {})
    exact = entries.get(f"{kind} {shape} @{rows}", {}) if rows != "*" else {}
    return {**entries.get(f"{kind} {shape} @*", {}), **exact}


def lookup(kernel: str, kind: str, shape: str, rows, device) -> dict:
    """The fields the tables give for one launch on ``device`` (a torch device or a DeviceRecord),
    pinned tables first; ``{}`` where none does (the caller computes the fallback)."""
    record = _record(device)
    key = (record, kernel, kind, shape, rows)
    if key not in _ANSWERS:
        found: dict = {}
        for table in [table_for(record)] + _PINNED[::-1]:  # later updates win: the first pinned last
            if table is not None:
                found.update(_fields(table, kernel, kind, shape, rows))
        _ANSWERS[key] = found
    return dict(_ANSWERS[key])


def gemv(n: int, k: int, quant: bool, rows: int, device, *, weights: int = 1,
         x_bytes: int = 2) -> tuple[tuple[int, ...], int]:
    """(config, split) of a GEMV launch: ``n`` output columns in all (a group of ``weights``
    weights), width ``k``, int8 / fp8 weights (``quant``) or float, ``rows`` rows of ``x_bytes``
    bytes an element. config = (BLOCK_N, BLOCK_K, warps, stages[, K slices])."""
    record = _record(device)
    found = lookup("gemv", "quant" if quant else "float", f"{n}x{k}", rows, record)
    config = tuple(found["config"]) if "config" in found else \
        fallback.gemv_config(n, k, quant, rows, record, weights, x_bytes)
    split = int(found["split"]) if "split" in found else \
        fallback.gemv_split(n, k, quant, record, config[0], config[1])
    return config, split


#: 4-bit weight format (``gemv4.FORMATS``) -> its kind in a table's gemv keys
GEMV4_KINDS = {"convrot_w4a4": "w4a4", "nvfp4": "nvfp4"}


#: rows of x the 4-bit word tile takes (``gemv4w.py``: one unrolled accumulator per row)
WORD_ROWS = 8


def gemv4_words(fmt: str, k: int, rows: int) -> bool:
    """True where a 4-bit product runs ``gemv4w.py``'s word tile (convrot_w4a4 or nvfp4, K a multiple
    of 8, at most ``WORD_ROWS`` rows; the storage's alignment is checked by ``gemv4.gemv4_group``),
    else ``gemv4.py``'s tensor-core tile."""
    return fmt in ("convrot_w4a4", "nvfp4") and k % 8 == 0 and 1 <= rows <= WORD_ROWS


def gemv4(n: int, k: int, fmt: str, rows: int, device, *, weights: int = 1,
          x_bytes: int = 2, words: bool | None = None) -> tuple[tuple[int, ...], int]:
    """(config, split) of a 4-bit GEMV launch: as ``gemv``. The word tile (``words``, default
    ``gemv4_words``): the table's kind for the format (``GEMV4_KINDS``: ``w4a4`` / ``nvfp4``), else
    ``fallback.gemv4_pick`` (the word tile, or on sm_80+ the register tile: nvfp4 at any row count,
    convrot_w4a4 from ``fallback.MMA_ROWS`` rows) and its split; config = (BLOCK_N, BLOCK_K in weight
    columns, warps, stages[, 1: vector loads; 2: the register tile]). The tensor-core tile (more
    rows, storage not on words): ``fallback.gemv4_config``; config = (BLOCK_N, BLOCK_K in weight
    columns, warps, stages)."""
    record = _record(device)
    if gemv4_words(fmt, k, rows) if words is None else words:
        found = lookup("gemv", GEMV4_KINDS[fmt], f"{n}x{k}", rows, record)
        config = tuple(found["config"]) if "config" in found else fallback.gemv4_pick(n, k, rows, record, fmt)
        if "split" in found:
            split = int(found["split"])
        elif len(config) > 4 and config[4] == 2:
            split = fallback.gemv4m_split(n, k)
        else:
            split = fallback.gemv4w_split(n, k, record, config[0], config[1])
        return config, split
    config = fallback.gemv4_config(n, k, rows, record, weights, x_bytes, fmt)
    return config, fallback.gemv_split(n, k, True, record, config[0], config[1])


def split_k(n: int, k: int, quant: bool, rows: int, device) -> int:
    """K ranges for one ``[n, k]`` product read by ``rows`` rows whose consumer sums the float32
    partials (``gemv_group(split=)``): ``gemv``'s split."""
    return gemv(n, k, quant, rows, device)[1]


def deltanet(dk: int, dv: int, rows: int, rotate: bool, device) -> tuple[int, int]:
    """(value-column blocks per head, warps) of a DeltaNet step launch of ``rows`` rows."""
    record = _record(device)
    found = lookup("deltanet", "rotate" if rotate else "plain", f"{dk}x{dv}", rows, record)
    blocks, warps = fallback.deltanet(dk, dv, rows, rotate)
    return int(found.get("blocks", blocks)), int(found.get("warps", warps))


def attention(d: int, g: int, rows: int, programs: int, itemsize: int, block_m: int, device,
              smaller: int = 0) -> tuple[int, dict]:
    """(split count, split-pass tile ``{"BLOCK_N", "num_stages", "num_warps"}``) of a decode
    attention launch: head dim ``d``, ``g`` query heads per kv head, ``rows`` new rows, ``programs``
    programs before the split. ``smaller``: how many tiles past the fallback's first choice (after a
    launch that did not fit)."""
    record = _record(device)
    found = lookup("attention", f"d{d}", f"g{g}", rows, record)
    splits = int(found["splits"]) if "splits" in found else fallback.attention_splits(record, programs)
    tile = fallback.attention_tile(d, itemsize, block_m, record, smaller)
    if not smaller:
        tile.update({k: int(found[k]) for k in ("BLOCK_N", "num_stages", "num_warps") if k in found})
    return splits, tile


def prefetch(device) -> tuple[int, int]:
    """(bytes of the next product's weight a GEMV asks L2 for, the same for a mixer's input product,
    whose successor runs after the mixer)."""
    record = _record(device)
    found = lookup("prefetch", "l2", "*", "*", record)
    nbytes = int(found.get("bytes", fallback.prefetch_bytes(record)))
    return nbytes, int(found.get("mixer_bytes", nbytes))


def _record(device) -> DeviceRecord | None:
    return device if isinstance(device, DeviceRecord) or device is None else device_record(device)
