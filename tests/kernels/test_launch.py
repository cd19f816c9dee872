"""Launch settings as data (``kernels/launch.py``, ``kernels/fallback.py``, ``kernels/tuned/*.json``).

The migration oracle is ``legacy_picks.py``: the pick functions as code, frozen as they were before
the tables. The H100 and H200 tables (with the computed fallback for what they leave out) must give
exactly those picks for every launch of the 9B decode step (``consumer_step.py`` lists them).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from qwen35_fast.kernels import fallback, launch
from qwen35_fast.kernels.capabilities import DeviceRecord

from tests.kernels import legacy_picks as legacy

ROOT = Path(__file__).resolve().parents[2]
H, INTER, VOCAB = 4096, 12288, 248320
HOPPER_SHARED = 227 * 1024
#: (name, columns in all, K, weights in the group, a split-K product): every GEMV of the 9B step
NINE_B = [("DeltaNet inputs", 12352, H, 4, False), ("DeltaNet out_proj", H, H, 1, True),
          ("gate/up", 2 * INTER, H, 2, False), ("MLP down", H, INTER, 1, True),
          ("attention q/k/v", 10240, H, 3, False), ("attention o_proj", H, 4096, 1, True),
          ("lm_head", VOCAB, H, 1, False), ("MTP fc", H, 2 * H, 1, False)]
H200 = DeviceRecord("NVIDIA H200", 90, 132, HOPPER_SHARED, 60 << 20)
H100 = DeviceRecord("NVIDIA H100 80GB HBM3", 90, 132, HOPPER_SHARED, 50 << 20)
#: GPUs the pack has no table for: (record, Qwen3.5 hidden sizes it must handle)
OTHERS = [DeviceRecord("NVIDIA A100-SXM4-80GB", 80, 108, 163 * 1024, 40 << 20),
          DeviceRecord("NVIDIA GeForce RTX 3060", 86, 28, 99 * 1024, 3 << 20),
          DeviceRecord("NVIDIA GeForce RTX 4090 Laptop GPU", 89, 76, 99 * 1024, 64 << 20),
          DeviceRecord("NVIDIA GeForce RTX 5090", 120, 170, 99 * 1024, 96 << 20)]
#: (hidden, intermediate, DeltaNet key / value heads, attention q / kv heads) of Qwen3.5 0.8B .. 27B
SIZES = [(1024, 3584, 16, 16, 8, 2), (2048, 6144, 16, 16, 8, 2), (2560, 9216, 16, 32, 16, 4),
         (4096, 12288, 16, 32, 16, 4), (5120, 17408, 16, 48, 24, 4)]


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """Each test reads the shipped tables afresh (no extra folder) and leaves no answer behind."""
    monkeypatch.delenv(launch.TUNED_DIR_ENV, raising=False)
    def forget():
        launch._tables.cache_clear()
        launch._CHOSEN.clear()
        launch._ANSWERS.clear()

    forget()
    yield
    forget()


@pytest.mark.parametrize("gpu", [H200, H100], ids=["H200", "H100"])
def test_the_hopper_tables_reproduce_the_picks_they_replace(gpu):
    assert launch.table_for(gpu)["device"] == gpu.name
    for name, n, k, weights, split in NINE_B:
        for quant in (True, False):
            for rows in range(1, 9):
                config, got_split = launch.gemv(n, k, quant, rows, gpu, weights=weights)
                assert config == legacy.gemv_config(n, k, quant, rows, gpu.shared), (name, quant, rows)
                if split:
                    assert got_split == legacy.gemv_split(n, k, quant), (name, quant, rows)
    for rows in range(1, 9):
        for rotate in (False, True):
            assert launch.deltanet(128, 128, rows, rotate, gpu) == legacy.deltanet(128, 128, rows, rotate)
        g, hkv = 4, 4
        block_m = max(16, 1 << (g * rows - 1).bit_length())
        programs = hkv * -(-g * rows // block_m)
        splits, tile = launch.attention(256, g, rows, programs, 2, block_m, gpu)
        assert splits == legacy.attention_splits(gpu.sms, programs)
        assert tile == legacy.attention_tile(256, 2, block_m, gpu.shared)
    assert launch.prefetch(gpu) == (legacy.PREFETCH_BYTES, legacy.MIXER_PREFETCH_BYTES)


def test_the_interpreter_keeps_the_picks_it_had():
    """No GPU (the CPU interpreter): the fallback gives the 9B launches the picks they had."""
    for name, n, k, weights, split in NINE_B:
        for quant in (True, False):
            config, got_split = launch.gemv(n, k, quant, 1, None, weights=weights)
            assert config == legacy.gemv_config(n, k, quant, 1, None), name
            if split:
                assert got_split == legacy.gemv_split(n, k, quant), name
    assert launch.attention(256, 4, 1, 4, 2, 16, None) == (4, legacy.attention_tile(256, 2, 16, 1 << 30))


def _launches(hidden, inter, hk, hv, hq, hkv):
    """(columns in all, K, weights, split-K product) of each GEMV of one Qwen3.5 size's step."""
    conv = 2 * hk * 128 + hv * 128
    return [(conv + hv * 128 + 2 * hv, hidden, 4, False), (hidden, hv * 128, 1, True), (2 * inter, hidden, 2, False),
            (hidden, inter, 1, True), (2 * hq * 256 + 2 * hkv * 256, hidden, 3, False),
            (hidden, hq * 256, 1, True), (VOCAB, hidden, 1, False), (hidden, 2 * hidden, 1, False)]


@pytest.mark.parametrize("gpu", OTHERS, ids=[g.name for g in OTHERS])
def test_the_fallback_fits_every_gpu_and_every_size(gpu):
    """A GPU with no table of its own gets, for every Qwen3.5 size, tiles whose shared memory (as Triton
    3.9 allocates it, the most any supported Triton does) fits the block, powers of two, enough
    programs for its SMs where K is split, and an attention tile that fits."""
    assert launch.table_for(gpu) is None
    for size in SIZES:
        for n, k, weights, split in _launches(*size):
            for quant in (True, False):
                for rows in (1, 4, 8):
                    for x_bytes in (2, 4):
                        config, parts = launch.gemv(n, k, quant, rows, gpu, weights=weights, x_bytes=x_bytes)
                        need = fallback.gemv_shared(config, weights, 1 if quant else 2, x_bytes)
                        assert need <= gpu.shared, (size, n, k, quant, rows, config, need)
                        bn, bk, warps, stages = config[:4]
                        assert all(v & (v - 1) == 0 for v in (bn, bk, warps)) and stages >= 2, config
                        assert parts & (parts - 1) == 0 and 1 <= parts <= 8
                        if split and parts > 1:
                            assert -(-n // bn) * parts <= 8 * gpu.sms  # no more splits than the SMs need
                for fmt in ("convrot_w4a4", "nvfp4"):
                    for rows in (1, 4, 8):
                        config, parts = launch.gemv4(n, k, fmt, rows, gpu, weights=weights)
                        bn, bk, warps, stages = config[:4]
                        assert all(v & (v - 1) == 0 for v in (bn, bk, warps)), config
                        if len(config) > 4 and config[4] == 2:  # the register tile: 16 rows a warp
                            assert (fmt == "nvfp4" or rows >= fallback.MMA_ROWS) and gpu.arch >= 80
                            assert bn == 16 and bk in (128, 256) and warps in (4, 8) and stages == 1, config
                            assert parts in (1, 4)
                            continue
                        if launch.gemv4_words(fmt, k, rows):  # the word tile: no shared memory, one warp
                            assert (warps, stages) == (1, 1) and 32 <= bk <= 512 and bn <= 32, config
                            assert parts & (parts - 1) == 0 and 1 <= parts <= 16
                            if split and parts > 1:
                                assert -(-n // bn) * parts <= 32 * gpu.sms  # under twice the 16 an SM aimed at
                            continue
                        need = weights * max(1, stages - 1) * (bn * bk // 2 + 16 * bk * 2)
                        assert need <= gpu.shared, (size, n, k, fmt, rows, config, need)
                        assert stages >= 2 and 32 <= bk <= 256 and bn >= 16, config  # wider K tiles spill
                        assert parts & (parts - 1) == 0 and 1 <= parts <= 8
    for rows in (1, 4, 8):
        for itemsize in (2, 4):
            block_m = max(16, 1 << (4 * rows - 1).bit_length())
            splits, tile = launch.attention(256, 4, rows, 4, itemsize, block_m, gpu)
            assert 1 <= splits <= 128 and splits * 4 >= gpu.sms
            assert tile["num_stages"] * 2 * tile["BLOCK_N"] * 256 * itemsize < gpu.shared


def test_a_consumer_gpu_splits_k_for_its_own_sm_count():
    """Split-K follows the SM count: 4 ranges where 128 programs are a quarter of what 132 SMs need,
    2 on a 76-SM laptop GPU, none on a 28-SM one."""
    laptop, small = OTHERS[2], OTHERS[1]
    assert launch.gemv(H, H, True, 1, H200)[1] == 4
    assert launch.gemv(H, H, True, 1, laptop)[1] == 2
    assert launch.gemv(H, H, True, 1, small)[1] == 1


def _table(tmp_path, name, launches, **head):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**head, "launches": launches}))
    return path


def test_a_table_for_this_gpu_wins_then_one_of_its_architecture(tmp_path, monkeypatch):
    """The extra folder's tables: the one named for the GPU first, else the same architecture's
    with the nearest SM count; exact rows before ``*``, field by field over the fallback."""
    entry = {"gemv": {"quant 64x32 @*": {"config": [16, 32, 1, 2]}, "quant 64x32 @4": {"split": 2}}}
    _table(tmp_path, "mine", entry, device="GPU A", arch=89, sms=60)
    _table(tmp_path, "near", {"gemv": {"quant 64x32 @*": {"config": [32, 32, 2, 2]}}}, device="GPU B", arch=89,
           sms=80)
    _table(tmp_path, "far", {"gemv": {"quant 64x32 @*": {"config": [64, 32, 4, 2]}}}, device="GPU C", arch=89,
           sms=20)
    monkeypatch.setenv(launch.TUNED_DIR_ENV, str(tmp_path))
    mine = DeviceRecord("GPU A", 89, 60, 99 * 1024, 1 << 20)
    other = DeviceRecord("GPU D", 89, 76, 99 * 1024, 1 << 20)
    fallback_split = fallback.gemv_split(64, 32, True, mine, 16, 32)
    assert launch.gemv(64, 32, True, 1, mine) == ((16, 32, 1, 2), fallback_split)
    assert launch.gemv(64, 32, True, 4, mine) == ((16, 32, 1, 2), 2)
    assert launch.gemv(64, 32, True, 1, other)[0] == (32, 32, 2, 2)  # same architecture, 80 SMs nearest 76
    assert launch.gemv(64, 32, True, 1, DeviceRecord("GPU E", 86, 60, 99 * 1024, 1 << 20))[0] == \
        fallback.gemv_config(64, 32, True, 1, DeviceRecord("GPU E", 86, 60, 99 * 1024, 1 << 20))


def test_pinned_tables_win_within_their_block_only(tmp_path):
    first = _table(tmp_path, "a", {"deltanet": {"plain 128x128 @1": {"warps": 2}}})
    second = _table(tmp_path, "b", {"deltanet": {"plain 128x128 @1": {"warps": 8, "blocks": 2}}})
    assert launch.deltanet(128, 128, 1, False, H200) == (1, 4)
    with launch.pinned(first, second):
        assert launch.deltanet(128, 128, 1, False, H200) == (2, 2)  # the first pinned wins, field by field
        assert launch.deltanet(128, 128, 4, False, H200) == (4, 4)
    assert launch.deltanet(128, 128, 1, False, H200) == (1, 4)


@pytest.mark.parametrize("text,match", [
    ("{", "cannot read it"), ("[]", "no \"launches\" object"), ('{"launches": {"gemm": {}}}', "unknown kernel 'gemm'"),
    ('{"launches": {"gemv": {"quant 64x32": {}}}}', "is not '<kind> <shape> @<rows>'"),
    ('{"launches": {"gemv": {"quant 64x32 @*": {"config": [24, 32, 1, 2]}}}}', "config = [24, 32, 1, 2] must be"),
    ('{"launches": {"gemv": {"quant 64x32 @*": {"config": [16, 32, 1, 2, 4]}}}}', "K slices"),
    ('{"launches": {"gemv": {"quant 64x32 @1": {"split": 0}}}}', "split = 0 must be a whole number 1..64"),
    ('{"launches": {"deltanet": {"plain 128x128 @1": {"warps": 3}}}}', "warps = 3 must be a power of two 1..16"),
    ('{"launches": {"attention": {"d256 g4 @1": {"tiles": 3}}}}', "tiles = 3 must be one of splits, BLOCK_N"),
    ('{"launches": {"prefetch": {"l2 * @*": {"bytes": "8M"}}}}', "bytes = '8M' must be a whole number"),
])
def test_a_bad_table_is_named_with_the_fix(tmp_path, text, match, monkeypatch, caplog):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(launch.TableError, match=re.escape(str(path)) + ".*" + re.escape(match)):
        launch.read_table(path)
    with pytest.raises(launch.TableError):
        with launch.pinned(path):
            pass
    monkeypatch.setenv(launch.TUNED_DIR_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        assert launch.gemv(H, H, True, 1, H200)[1] == 4  # the shipped tables still load
    assert any(str(path) in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


def test_the_shipped_tables_are_valid_and_say_where_they_came_from():
    tables = sorted((ROOT / "kernels" / "tuned").glob("*.json"))
    assert {launch.read_table(p)["device"] for p in tables} >= {H200.name, H100.name}
    for path in tables:
        table = launch.read_table(path)
        assert {"gpu", "triton", "results"} <= set(table["provenance"]), path
        for result in table["provenance"]["results"]:
            assert (ROOT / result).exists(), (path, result)


def test_the_runtime_reads_two_variables_of_its_own():
    """No launch setting is read from the environment: the pack's runtime names only the PDL switch
    and the extra tables folder."""
    found = set()
    for folder in ("kernels", "engine", "patches", "nodes", "enhancer", "downloads"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"QWEN35_FAST_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert found == {"QWEN35_FAST_PDL", "QWEN35_FAST_TUNED_DIR"}, found


def test_the_register_tile_pick_is_what_the_h100_measured():
    """Where no table names a convrot_w4a4 launch, a verify's rows run on the register tile with the
    config that won at 4 rows on an H100 (``benchmarks/results/gemv4_tiles_h100.json``, or one within
    3% of it), and a decode row on the word tile, which won there at 1 row; nvfp4 rows run on the
    register tile at 1 and 4 rows, within 5% of the fastest config timed (``gemv4_tiles_h100_nvfp4.json``),
    which beat the word tile at every launch; with the H100's table, each nvfp4 launch within 2% of
    the fastest config timed after the tile's conversion changed (``gemv4_tiles_h100_nvfp4_bits.json``);
    on an A100 (sm_80+) the same; a GPU below sm_80 never gets it."""
    results = json.loads((ROOT / "benchmarks" / "results" / "gemv4_tiles_h100.json").read_text())
    checked = 0
    for row in results["rows"]:
        n, k, rows = row["n"], row["k"], row["rows"]
        timed = {(tuple(c), p): us for c, p, us in row["mma"]}
        if rows == 4:
            config, split = fallback.gemv4_pick(n, k, rows, H100), fallback.gemv4m_split(n, k)
            best = min(timed.values())
            assert timed[(config, split)] <= 1.03 * best, (row["launch"], config, split)
            checked += 1
        else:  # the word tile at 1 row: it won at every launch but one (q/k/v, by 7%)
            assert fallback.gemv4_pick(n, k, rows, H100)[4] == 1
            assert row["word"][2] <= 1.08 * min(timed.values()), row["launch"]
    assert checked == 6
    nvfp4 = json.loads((ROOT / "benchmarks" / "results" / "gemv4_tiles_h100_nvfp4.json").read_text())
    for row in nvfp4["rows"]:
        n, k, rows = row["n"], row["k"], row["rows"]
        timed = {(tuple(c), p): us for c, p, us in row["mma"]}
        config, split = fallback.gemv4_pick(n, k, rows, H100, "nvfp4"), fallback.gemv4m_split(n, k)
        assert config[4] == 2 and timed[(config, split)] <= 1.05 * min(timed.values()), (row["launch"], rows)
        assert timed[(config, split)] < row["word"][2], row["launch"]
        checked += 1
    # the H100's table: the tile's configs timed again after its nvfp4 conversion changed; each launch
    # within 2% of the fastest (the table names those that won by more)
    bits = json.loads((ROOT / "benchmarks" / "results" / "gemv4_tiles_h100_nvfp4_bits.json").read_text())
    for row in bits["rows"]:
        timed = {(tuple(c), p): us for c, p, us in row["mma"]}
        config, split = launch.gemv4(row["n"], row["k"], "nvfp4", row["rows"], H100)
        assert timed[(config, split)] <= 1.02 * min(timed.values()), (row["launch"], row["rows"])
        checked += 1
    assert checked == 30
    a100, turing = OTHERS[0], DeviceRecord("NVIDIA GeForce RTX 2080", 75, 46, 64 * 1024, 4 << 20)
    for rows in range(1, 9):
        assert (fallback.gemv4_pick(4096, 4096, rows, a100)[4] == 2) == (rows >= fallback.MMA_ROWS)
        assert fallback.gemv4_pick(4096, 4096, rows, turing)[4] == 1
        assert fallback.gemv4_pick(4096, 4096, rows, a100, "nvfp4")[4] == 2
        assert fallback.gemv4_pick(4096, 4096, rows, turing, "nvfp4")[4] == 1
