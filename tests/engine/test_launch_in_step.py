"""Launch tables in the decode step (``kernels/launch.py``): a fused plan built inside
``launch.pinned(table)`` launches the GEMV, the DeltaNet step and the decode attention with the
table's settings (the same tokens as the torch path) and the picks again outside it; a launch that
does not fit the GPU takes fewer stages and says so once; a Triton without K slices gets unsliced
tiles; ``benchmarks/comfy_e2e.py --variants`` reads table files."""

import argparse
import json
import os

import pytest
import torch
from qwen35_fast.engine import generate
from qwen35_fast.kernels import attention_triton, deltanet_step, fallback, gemv, interpreting, launch

from tests.oracles.tiny import add_mtp, engine_model, make_tiny

INTERPRETER = pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")


@pytest.fixture
def tiny(tmp_path, test_seed):
    sd, d = make_tiny(test_seed % 10_000, strength=0.3, vocab_size=64, hidden_size=64, num_hidden_layers=4)
    return engine_model(sd, tmp_path), d


def _table(tmp_path, launches, name="variant"):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"launches": launches}))
    return path


class _Spy:
    """Stands in for a Triton kernel: records ``record(grid, args, kwargs)`` of each launch."""

    def __init__(self, real, record):
        self.real, self.record, self.launches = real, record, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(self.record(tuple(grid), args, kw))
            return self.real[grid](*args, **kw)
        return launch


def _gemv_launch(grid, args, kw):
    """A ``_gemv_kernel`` launch: grid, rows, K, output columns, (BLOCK_N, BLOCK_K, warps, stages)."""
    return {"grid": grid, "rows": args[13], "k": args[14], "ns": tuple(n for n in args[16:20] if n),
            "cfg": (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"])}


def _picked(n, k):
    """The fallback's pick for [n, k] on the interpreter, its tile clamped to K as ``gemv_group`` clamps it."""
    bn, bk, warps, stages = fallback.gemv_config(n, k, False, 1, None)
    return bn, min(bk, 1 << (k - 1).bit_length()), warps, stages


@INTERPRETER
def test_plan_launches_with_a_pinned_table(tiny, rng, monkeypatch, tmp_path):
    model, d = tiny
    h, inter = d["hidden_size"], d["intermediate_size"]
    spy = _Spy(gemv._gemv_kernel, _gemv_launch)
    monkeypatch.setattr(gemv, "_gemv_kernel", spy)
    prompt = torch.randn(1, 9, h, generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens
    table = _table(tmp_path, {"gemv": {f"float {h}x{inter} @*": {"config": [16, 16, 1, 1], "split": 3},
                                       f"float {2 * inter}x{h} @*": {"config": [32, 32, 2, 2]}}})

    def run(*tables):
        """Tokens, the MLP down launches (h columns over the intermediate width) and the gate/up ones."""
        spy.launches.clear()
        with launch.pinned(*tables):
            tokens = generate(model, prompt, fused=True, **kw).tokens
        down = [x for x in spy.launches if x["ns"] == (h,) and x["k"] == inter]
        gate_up = [x for x in spy.launches if x["ns"] == (inter, inter) and x["k"] == h]
        assert down and gate_up, spy.launches
        return tokens, down, gate_up

    tokens, down, gate_up = run()
    assert tokens == want
    assert {x["cfg"] for x in down} == {_picked(h, inter)}
    assert {x["cfg"] for x in gate_up} == {_picked(2 * inter, h)}
    tokens, down, gate_up = run(table)
    assert tokens == want
    assert {(x["cfg"], x["grid"]) for x in down} == {((16, 16, 1, 1), (h // 16, 3))}  # 3 K ranges of 32
    assert {(x["cfg"], x["grid"]) for x in gate_up} == {((32, 32, 2, 2), (2 * -(-inter // 32), 1))}
    tokens, down, _ = run()
    assert tokens == want and {x["cfg"] for x in down} == {_picked(h, inter)}


@INTERPRETER
def test_row_count_entries_apply_to_those_rows_only(tmp_path, test_seed, rng, monkeypatch):
    """``@4``: the MTP-3 verify's 4-row launches (and the head's catch-up over them) take the entry,
    the drafts' 1-row ones the ``@*`` entry; same tokens as the module path."""
    sd, d = make_tiny(test_seed % 10_000, strength=0.2, vocab_size=64, hidden_size=64, num_hidden_layers=4)
    model = engine_model(add_mtp(sd, d, test_seed % 9_999, noise=0.02), tmp_path)
    h, inter = d["hidden_size"], d["intermediate_size"]
    spy = _Spy(gemv._gemv_kernel, _gemv_launch)
    monkeypatch.setattr(gemv, "_gemv_kernel", spy)
    prompt = torch.randn(1, 7, h, generator=rng)
    kw = dict(do_sample=False, max_length=14, stop_tokens=[], mtp=3, attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens
    table = _table(tmp_path, {"gemv": {f"float {h}x{inter} @4": {"config": [16, 16, 1, 1], "split": 3},
                                       f"float {h}x{inter} @*": {"config": [32, 16, 1, 1]}}})
    with launch.pinned(table):
        got = generate(model, prompt, fused=True, **kw).tokens
    assert got == want
    down = [x for x in spy.launches if x["ns"] == (h,) and x["k"] == inter]
    by_rows = {}
    for x in down:
        by_rows.setdefault(x["rows"], set()).add((x["cfg"], x["grid"]))
    assert set(by_rows) >= {1, 4}, by_rows
    assert by_rows[4] == {((16, 16, 1, 1), (h // 16, 3))}  # the row entry: its tile, 3 K ranges
    assert {cfg for cfg, _ in by_rows[1]} == {(32, 16, 1, 1)}  # the entry for any rows


@INTERPRETER
def test_launch_that_does_not_fit_takes_fewer_stages_and_says_so_once(rng, monkeypatch, caplog, tmp_path):
    """A picked launch that needs more shared memory than the GPU has (bf16 weights or float32 x on a 99 KB
    consumer GPU) runs with fewer pipeline stages, the same product, one warning per shape naming the
    tune command; an explicit ``config=`` still raises, and so does one stage that does not fit."""
    from triton.runtime.errors import OutOfResources

    k, n = 192, 40
    x = torch.randn(2, k, generator=rng)
    q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
    s = torch.rand(n, generator=rng) * 1e-3 + 1e-4
    ref = (x.double() @ q.double().T) * s.double()
    monkeypatch.setattr(gemv, "_SHRUNK", {})
    table = _table(tmp_path, {"gemv": {f"quant {n}x{k} @*": {"config": [16, 64, 4, 4, 2]}}})
    stages, fits = [], [2]

    def small_shared_memory(grid, args, kw):  # a GPU holding ``fits[0]`` stages: deeper launches fail
        stages.append(kw["num_stages"])  # as a launch does, before the kernel runs
        if kw["num_stages"] > fits[0]:
            raise OutOfResources(160 * 1024, 99 * 1024, "shared memory")

    monkeypatch.setattr(gemv, "_gemv_kernel", _Spy(gemv._gemv_kernel, small_shared_memory))
    with caplog.at_level("WARNING", logger=gemv.__name__), launch.pinned(table):
        first = gemv.gemv(x, q, s)
        second = gemv.gemv(x, q, s)
    for out in (first, second):
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert stages == [4, 3, 2, 2]  # shrunk once, then launched at the depth that fit
    said = [r.getMessage() for r in caplog.records if r.name == gemv.__name__]
    assert len(said) == 1 and "shared memory" in said[0] and "2 pipeline stages instead of 4" in said[0]
    assert "benchmarks/tune.py" in said[0]
    with pytest.raises(OutOfResources):
        gemv.gemv(x, q, s, config=(16, 64, 4, 3))
    fits[0] = 0
    monkeypatch.setattr(gemv, "_SHRUNK", {})
    with pytest.raises(OutOfResources), launch.pinned(table):
        gemv.gemv(x, q, s)


def test_a_triton_without_k_slices_gets_unsliced_tiles_and_refuses_sliced_configs(rng, monkeypatch, caplog):
    """Before Triton 3.3 the K-sliced tile does not compile (``tests/kernels/consumer_step.py`` under
    Triton 3.0-3.2: a CompilationError, and 3.2's compiler aborts the process once that is worked
    around). There the DeltaNet inputs and q/k/v get the unsliced tiles picked before them, said
    once, and an explicit config with K slices is refused before any launch."""
    from qwen35_fast.kernels import capabilities

    why = "Triton 3.2.0 cannot compile K-sliced GEMV tiles (Triton 3.3+ can)"
    monkeypatch.setattr(gemv, "SLICES_REASON", why)
    monkeypatch.setattr(capabilities, "_SAID", set())
    with caplog.at_level("WARNING", logger=gemv.__name__):
        picks = [gemv._picked(n, 4096, True, 1, torch.zeros(1, 4096), 1) for n in (12352, 10240)]
    assert picks == [(32, 128, 4, 5), (32, 256, 4, 4)]  # the picks of 76ace7d, before K slices
    said = [r.getMessage() for r in caplog.records if r.name == gemv.__name__]
    assert len(said) == 1 and why in said[0]
    k, n = 128, 24
    x = torch.randn(1, k, generator=rng)
    q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
    s = torch.rand(n, generator=rng) * 1e-3 + 1e-4
    launched = []
    monkeypatch.setattr(gemv, "_gemv_kernel", _Spy(gemv._gemv_kernel, lambda grid, args, kw: launched.append(kw)))
    with pytest.raises(ValueError, match=r"gemv: config \(16, 64, 4, 2, 2\) has K slices: Triton 3\.2\.0"):
        gemv.gemv(x, q, s, config=(16, 64, 4, 2, 2))
    assert not launched
    out = gemv.gemv(x, q, s, config=(16, 64, 4, 2))  # four values still run
    assert launched and ((out.double() - (x.double() @ q.double().T) * s.double()).abs().max() < 1e-4)


@INTERPRETER
def test_plan_launches_the_deltanet_step_with_a_pinned_table(tiny, rng, monkeypatch, tmp_path):
    """One row, fp32 (no rotation): whole heads by default; a table's 2 blocks of 2 warps split each
    head's value columns over 2 programs (the gated norm then runs in its own kernel)."""
    model, d = tiny
    spy = _Spy(deltanet_step._step_kernel, lambda grid, args, kw: (grid, kw["num_warps"]))
    monkeypatch.setattr(deltanet_step, "_step_kernel", spy)
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens
    heads = d["linear_num_value_heads"]
    dk, dv = d["linear_key_head_dim"], d["linear_value_head_dim"]
    table = _table(tmp_path, {"deltanet": {f"plain {dk}x{dv} @1": {"blocks": 2, "warps": 2}}})
    for tables, picked in (((), ((heads, 1), 4)), ((table,), ((heads, 2), 2)), ((), ((heads, 1), 4))):
        spy.launches.clear()
        with launch.pinned(*tables):
            assert generate(model, prompt, fused=True, **kw).tokens == want
        assert spy.launches and set(spy.launches) == {picked}


@INTERPRETER
def test_plan_launches_the_attention_with_a_pinned_table(tiny, rng, monkeypatch, tmp_path):
    """One row, triton attention: the interpreter's 4 splits and the fallback's tile; a table's entry
    cuts the cache in 3 splits of 16-row tiles, 1 stage, 2 warps; same tokens as the torch path."""
    model, d = tiny
    spy = _Spy(attention_triton._split_kernel,
               lambda grid, args, kw: (grid[1], kw["BLOCK_N"], kw["num_stages"], kw["num_warps"]))
    monkeypatch.setattr(attention_triton, "_split_kernel", spy)
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="triton")
    want = generate(model, prompt, fused=False, **dict(kw, attention="torch")).tokens
    default = fallback.attention_tile(d["head_dim"], 4, 16, None)
    default = (4, default["BLOCK_N"], default["num_stages"], default["num_warps"])
    g = d["num_attention_heads"] // d["num_key_value_heads"]
    entry = {"splits": 3, "BLOCK_N": 16, "num_stages": 1, "num_warps": 2}
    table = _table(tmp_path, {"attention": {f"d{d['head_dim']} g{g} @1": entry}})
    for tables, picked in (((), default), ((table,), (3, 16, 1, 2)), ((), default)):
        spy.launches.clear()
        with launch.pinned(*tables):
            assert generate(model, prompt, fused=True, **kw).tokens == want
        assert spy.launches and set(spy.launches) == {picked}


def test_benchmark_compares_medians_with_the_pack_row():
    """``comfy_e2e.compare``: per format and max_length, each pack kind's median over its runs and
    its ratio to the plain pack row's median (a forced MTP-3 variant's to the forced3 row's);
    nothing to compare without variants or repeats."""
    from benchmarks.comfy_e2e import compare

    def r(kind, tok_s, fmt="int8", length=4096):
        return {"format": fmt, "kind": kind, "max_length": length, "tok_s": tok_s}

    rows = [r("first-use", 1.0), r("pack", 300.0), r("pack@a", 330.0), r("core", 9.0), r("pack", 310.0),
            r("pack@a", 320.0), r("pack", 350.0), r("pack@a", 336.0), r("pack", 100.0, "bf16"),
            r("pack-forced3", 800.0), r("pack-forced3@a", 840.0), r("pack-forced3", 820.0),
            r("pack-forced3@a", 850.0)]
    got = {(m["format"], m["kind"]): (m["runs"], m["tok_s"], round(m["ratio"], 6)) for m in compare(rows)}
    assert got == {("int8", "pack"): (3, 310.0, 1.0), ("int8", "pack@a"): (3, 330.0, round(330 / 310, 6)),
                   ("bf16", "pack"): (1, 100.0, 1.0), ("int8", "pack-forced3"): (2, 810.0, 1.0),
                   ("int8", "pack-forced3@a"): (2, 845.0, round(845 / 810, 6))}
    assert compare([r("pack", 300.0), r("pack", 200.0, "bf16"), r("core", 9.0)]) == []


def test_benchmark_variants_are_table_files(tmp_path):
    """``comfy_e2e.py --variants NAME:TABLE.json``: the table is read when the argument is, a bad one
    refused naming it; a row's table holds while it runs, and pack-plain turns PDL off, both undone
    after."""
    from benchmarks.comfy_e2e import launches, parse_variant

    good = _table(tmp_path, {"deltanet": {"plain 128x128 @1": {"warps": 2}}}, "good")
    bad = _table(tmp_path, {"deltanet": {"plain 128x128 @1": {"warps": 3}}}, "bad")
    assert parse_variant(f"w2:{good}") == ("w2", str(good))
    for text, match in ((f"w2:{bad}", "warps = 3"), ("w2", "NAME:TABLE.json"), (f"a b:{good}", "NAME:TABLE.json")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_variant(text)
    os.environ.pop("QWEN35_FAST_PDL", None)
    with launches("pack-plain", str(good)):
        assert launch.deltanet(128, 128, 1, False, None) == (1, 2) and os.environ["QWEN35_FAST_PDL"] == "0"
    assert launch.deltanet(128, 128, 1, False, None) == (1, 4) and "QWEN35_FAST_PDL" not in os.environ
