"""``QWEN35_FAST_GEMV_CONFIG`` / ``QWEN35_FAST_DELTANET_CONFIG`` / ``QWEN35_FAST_ATTENTION_CONFIG``:
launch overrides for measuring decode kernels in the step itself. The value is parsed into settings
per shape, a malformed one is refused naming the format, and a fused plan built after the variable
changes launches with the new settings (the same tokens as the torch path), the measured defaults
again once it is unset."""

import argparse
import os

import pytest
import torch
from qwen35_fast.engine import bind, generate
from qwen35_fast.engine.fused import FusedPlan
from qwen35_fast.kernels import attention_triton, deltanet_step, gemv, interpreting

from tests.oracles.tiny import add_mtp, engine_model, make_tiny

ENV = "QWEN35_FAST_GEMV_CONFIG"


def test_parse_reads_every_form():
    text = (" quant:12352x4096=32,256,4,3; float:64X96=/3 ;;quant:4096x12288=32,256,2,4/4;quant:8x64=16,64,4,2,4/2;"
            "quant:4096x12288@4=/3; float:64x96@16=32,64,4,2")
    assert gemv.parse_overrides(text) == {
        (True, 12352, 4096): ((32, 256, 4, 3), None),
        (False, 64, 96): (None, 3),
        (True, 4096, 12288): ((32, 256, 2, 4), 4),
        (True, 8, 64): ((16, 64, 4, 2, 4), 2),
        (True, 4096, 12288, 4): (None, 3),
        (False, 64, 96, 16): ((32, 64, 4, 2), None),
    }
    assert gemv.parse_overrides("") == {}


@pytest.mark.parametrize("bad", [
    "int8:64x96=16,16,1,1",  # kind is quant or float
    "quant:64x96",  # no '='
    "quant:64*96=16,16,1,1",  # shape NxK
    "quant:64x96=16,16,1",  # four numbers
    "quant:64x96=24,16,1,1",  # BLOCK_N a power of two
    "quant:64x96=16,16,3,1",  # warps a power of two
    "quant:64x96=16,16,1,9",  # stages 1..8
    "quant:64x96=16,64,1,2,3",  # K slices a power of two
    "quant:64x96=16,64,1,2,8",  # K slices at least 16 wide
    "quant:64x96=16,64,1,2,4,1",  # at most five numbers
    "quant:64x96=/0",  # split >= 1
    "quant:64x96=/",  # nothing to override
    "quant:64x96@0=/2",  # rows 1..16
    "quant:64x96@17=/2",
    "quant:64x96@four=/2",  # rows a number
])
def test_malformed_entries_name_the_format(bad):
    with pytest.raises(ValueError, match=rf"{ENV}: .*'quant:4096x12288=32,256,2,4/4'"):
        gemv.parse_overrides(f"float:64x64=/2;{bad}")


@pytest.fixture
def tiny(tmp_path, test_seed):
    sd, d = make_tiny(test_seed % 10_000, strength=0.3, vocab_size=64, hidden_size=64, num_hidden_layers=4)
    return engine_model(sd, tmp_path), d


class _Spy:
    """Stands in for a Triton kernel: records ``record(grid, args, kwargs)`` of each launch."""

    def __init__(self, real, record):
        self.real, self.record, self.launches = real, record, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(self.record(tuple(grid), args, kw))
            return self.real[grid](*args, **kw)
        return launch


def _env_entry_refused(monkeypatch, entry: str, match: str, call) -> None:
    """With ``ENV`` set to ``entry``, ``call()`` raises a ValueError matching ``match``; the overrides
    are read again without it afterwards."""
    monkeypatch.setenv(ENV, entry)
    gemv.load_overrides()
    try:
        with pytest.raises(ValueError, match=match):
            call()
    finally:
        monkeypatch.delenv(ENV)
        gemv.load_overrides()


def _set_env(monkeypatch, var: str, value: str | None) -> None:
    """``var`` set to ``value``, or unset when ``value`` is None (restored after the test)."""
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)


def _gemv_launch(grid, args, kw):
    """A ``_gemv_kernel`` launch: grid, rows, K, output columns, (BLOCK_N, BLOCK_K, warps, stages)."""
    return {"grid": grid, "rows": args[13], "k": args[14], "ns": tuple(n for n in args[16:20] if n),
            "cfg": (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"])}


def _picked(n, k):
    """The measured default for [n, k], its tile clamped to K as ``gemv_group`` clamps it."""
    bn, bk, warps, stages = gemv._default_config(n, k)
    return bn, min(bk, 1 << (k - 1).bit_length()), warps, stages


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_plan_launches_with_the_overrides(tiny, rng, monkeypatch):
    model, d = tiny
    h, inter = d["hidden_size"], d["intermediate_size"]
    spy = _Spy(gemv._gemv_kernel, _gemv_launch)
    monkeypatch.setattr(gemv, "_gemv_kernel", spy)
    prompt = torch.randn(1, 9, h, generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens

    def run(value):
        """Tokens, the MLP down launches (h columns over the intermediate width) and the gate/up ones."""
        _set_env(monkeypatch, ENV, value)
        spy.launches.clear()
        tokens = generate(model, prompt, fused=True, **kw).tokens
        down = [x for x in spy.launches if x["ns"] == (h,) and x["k"] == inter]
        gate_up = [x for x in spy.launches if x["ns"] == (inter, inter) and x["k"] == h]
        assert down and gate_up, spy.launches
        return tokens, down, gate_up

    tokens, down, gate_up = run(None)
    assert tokens == want
    assert {x["cfg"] for x in down} == {_picked(h, inter)}
    assert {x["cfg"] for x in gate_up} == {_picked(2 * inter, h)}
    tokens, down, gate_up = run(f"float:{h}x{inter}=16,16,1,1/3; float:{2 * inter}x{h}=32,32,2,2")
    assert tokens == want
    assert {(x["cfg"], x["grid"]) for x in down} == {((16, 16, 1, 1), (h // 16, 3))}  # 3 K ranges of 32
    assert {(x["cfg"], x["grid"]) for x in gate_up} == {((32, 32, 2, 2), (2 * -(-inter // 32), 1))}
    tokens, down, _ = run(None)
    assert tokens == want and {x["cfg"] for x in down} == {_picked(h, inter)}


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_row_count_entries_apply_to_those_rows_only(tmp_path, test_seed, rng, monkeypatch):
    """``NxK@4``: the MTP-3 verify's 4-row launches (and the head's catch-up over them) take the
    entry, the drafts' 1-row ones the entry without rows; same tokens as the module path."""
    sd, d = make_tiny(test_seed % 10_000, strength=0.2, vocab_size=64, hidden_size=64, num_hidden_layers=4)
    model = engine_model(add_mtp(sd, d, test_seed % 9_999, noise=0.02), tmp_path)
    h, inter = d["hidden_size"], d["intermediate_size"]
    spy = _Spy(gemv._gemv_kernel, _gemv_launch)
    monkeypatch.setattr(gemv, "_gemv_kernel", spy)
    prompt = torch.randn(1, 7, h, generator=rng)
    kw = dict(do_sample=False, max_length=14, stop_tokens=[], mtp=3, attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens
    monkeypatch.setenv(ENV, f"float:{h}x{inter}@4=16,16,1,1/3; float:{h}x{inter}=32,16,1,1")
    got = generate(model, prompt, fused=True, **kw).tokens
    assert got == want
    down = [x for x in spy.launches if x["ns"] == (h,) and x["k"] == inter]
    by_rows = {}
    for x in down:
        by_rows.setdefault(x["rows"], set()).add((x["cfg"], x["grid"]))
    assert set(by_rows) >= {1, 4}, by_rows
    assert by_rows[4] == {((16, 16, 1, 1), (h // 16, 3))}  # the row entry: its tile, 3 K ranges
    assert {cfg for cfg, _ in by_rows[1]} == {(32, 16, 1, 1)}  # the entry without rows


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_malformed_value_keeps_the_plan_off_and_says_why(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setenv(ENV, "quant:64x96=16,16,1")
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert plan is None and ENV in why and "separated by ';'" in why
    monkeypatch.delenv(ENV)
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert plan is not None, why


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
@pytest.mark.parametrize("var", ["QWEN35_FAST_L2_PREFETCH_KB", "QWEN35_FAST_L2_PREFETCH_MIXER_KB"])
def test_a_prefetch_length_that_is_no_number_still_loads_the_pack(tiny, var, monkeypatch):
    """On import such a value leaves the 8 MB defaults (a fresh process imports the kernels), and
    the plan is off naming the variable until it is fixed."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from _standalone import load_pack; load_pack(); "
            "from qwen35_fast.kernels import gemv; print(gemv.PREFETCH_BYTES, gemv.MIXER_PREFETCH_BYTES)")
    env = dict(os.environ, **{var: "8M"}, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, str(root)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(8192 << 10)] * 2
    model, _ = tiny
    monkeypatch.setenv(var, "8M")
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert plan is None and f"{var}='8M' is not a whole number of KB" in why
    monkeypatch.delenv(var)
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert plan is not None, why


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_launch_that_does_not_fit_takes_fewer_stages_and_says_so_once(rng, monkeypatch, caplog):
    """A picked launch that needs more shared memory than the GPU has (bf16 weights or float32 x on a 99 KB
    consumer GPU) runs with fewer pipeline stages, the same product, one warning per shape; an explicit
    ``config=`` still raises, an env entry raises naming the variable, one stage that does not fit
    raises."""
    from triton.runtime.errors import OutOfResources

    k, n = 192, 40
    x = torch.randn(2, k, generator=rng)
    q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
    s = torch.rand(n, generator=rng) * 1e-3 + 1e-4
    ref = (x.double() @ q.double().T) * s.double()
    monkeypatch.setattr(gemv, "_SHRUNK", {})
    monkeypatch.setattr(gemv, "_default_config", lambda n, k, quant=False, *rest: (16, 64, 4, 4, 2))
    stages, fits = [], [2]

    def small_shared_memory(grid, args, kw):  # a GPU holding ``fits[0]`` stages: deeper launches fail
        stages.append(kw["num_stages"])  # as a launch does, before the kernel runs
        if kw["num_stages"] > fits[0]:
            raise OutOfResources(160 * 1024, 99 * 1024, "shared memory")

    monkeypatch.setattr(gemv, "_gemv_kernel", _Spy(gemv._gemv_kernel, small_shared_memory))
    with caplog.at_level("WARNING", logger=gemv.__name__):
        first = gemv.gemv(x, q, s)
        second = gemv.gemv(x, q, s)
    for out in (first, second):
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert stages == [4, 3, 2, 2]  # shrunk once, then launched at the depth that fit
    said = [r.getMessage() for r in caplog.records if r.name == gemv.__name__]
    assert len(said) == 1 and "shared memory" in said[0] and "2 pipeline stages instead of 4" in said[0]
    with pytest.raises(OutOfResources):
        gemv.gemv(x, q, s, config=(16, 64, 4, 3))
    _env_entry_refused(monkeypatch, f"quant:{n}x{k}=16,64,4,3", rf"{ENV}: .*does not fit this GPU's shared memory",
                       lambda: gemv.gemv(x, q, s))
    fits[0] = 0
    monkeypatch.setattr(gemv, "_SHRUNK", {})
    with pytest.raises(OutOfResources):
        gemv.gemv(x, q, s)


def test_a_triton_without_k_slices_gets_unsliced_tiles_and_refuses_sliced_configs(rng, monkeypatch, caplog):
    """Before Triton 3.3 the K-sliced tile does not compile (``tests/consumer_step.py`` under Triton
    3.0-3.2: a CompilationError, and 3.2's compiler aborts the process once that is worked around).
    There the DeltaNet inputs and q/k/v get the unsliced tiles picked before them, said once, and a
    config with K slices, explicit or from the environment, is refused before any launch."""
    from qwen35_fast.kernels import capabilities

    why = "Triton 3.2.0 cannot compile K-sliced GEMV tiles (Triton 3.3+ can)"
    monkeypatch.setattr(gemv, "SLICES_REASON", why)
    monkeypatch.setattr(capabilities, "_SAID", set())
    with caplog.at_level("WARNING", logger=gemv.__name__):
        picks = [gemv._default_config(12352, 4096, True), gemv._default_config(10240, 4096, True)]
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
    _env_entry_refused(monkeypatch, f"quant:{n}x{k}=16,64,4,2,2", rf"{ENV} entry \(16, 64, 4, 2, 2\) has K slices",
                       lambda: gemv.gemv(x, q, s))
    assert not launched
    out = gemv.gemv(x, q, s, config=(16, 64, 4, 2))  # four values still run
    assert launched and ((out.double() - (x.double() @ q.double().T) * s.double()).abs().max() < 1e-4)


def test_deltanet_parse_reads_and_refuses():
    assert deltanet_step.parse_overrides(" 1r=4,4; 4=2,8 ;1=1,2") == {
        (1, True): (4, 4), (4, False): (2, 8), (1, False): (1, 2)}
    for bad in ("1r=4", "x=4,4", "1=3,4", "1=4,32", "0=1,4", "1r4,4"):
        with pytest.raises(ValueError, match=r"QWEN35_FAST_DELTANET_CONFIG: .*'1r=4,4'"):
            deltanet_step.parse_overrides(bad)


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_plan_launches_the_deltanet_step_with_the_overrides(tiny, rng, monkeypatch):
    """One row, fp32 (no rotation): whole heads by default; ``1=2,2`` splits each head's value
    columns over 2 programs of 2 warps (the gated norm then runs in its own kernel)."""
    model, d = tiny
    spy = _Spy(deltanet_step._step_kernel, lambda grid, args, kw: (grid, kw["num_warps"]))
    monkeypatch.setattr(deltanet_step, "_step_kernel", spy)
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="torch")
    want = generate(model, prompt, fused=False, **kw).tokens
    heads = d["linear_num_value_heads"]
    for value, launch in ((None, ((heads, 1), 4)), ("1=2,2", ((heads, 2), 2)), (None, ((heads, 1), 4))):
        _set_env(monkeypatch, deltanet_step.CONFIG_ENV, value)
        spy.launches.clear()
        assert generate(model, prompt, fused=True, **kw).tokens == want
        assert spy.launches and set(spy.launches) == {launch}


def test_attention_parse_reads_and_refuses():
    assert attention_triton.parse_overrides(" 1=66; 4=33,32,2,8 ;") == {
        1: (66, None), 4: (33, {"BLOCK_N": 32, "num_stages": 2, "num_warps": 8})}
    for bad in ("1=", "x=4", "0=4", "1=0", "1=129", "1=4,32,2", "1=4,48,2,4", "1=4,32,9,4", "1=4,32,2,3", "1:4"):
        with pytest.raises(ValueError, match=r"QWEN35_FAST_ATTENTION_CONFIG: .*'4=33,32,2,8'"):
            attention_triton.parse_overrides(bad)


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")
def test_plan_launches_the_attention_with_the_overrides(tiny, rng, monkeypatch):
    """One row, triton attention: the interpreter's 4 splits and the default tile; ``1=3,16,1,2``
    cuts the cache in 3 splits of 16-row tiles, 1 stage, 2 warps; same tokens as the torch path."""
    model, d = tiny
    spy = _Spy(attention_triton._split_kernel,
               lambda grid, args, kw: (grid[1], kw["BLOCK_N"], kw["num_stages"], kw["num_warps"]))
    monkeypatch.setattr(attention_triton, "_split_kernel", spy)
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=4, stop_tokens=[], mtp="off", attention="triton")
    want = generate(model, prompt, fused=False, **dict(kw, attention="torch")).tokens
    default = attention_triton.default_config(d["head_dim"], 4, 16, 1 << 30)
    default = (4, default["BLOCK_N"], default["num_stages"], default["num_warps"])
    for value, launch in ((None, default), ("1=3,16,1,2", (3, 16, 1, 2)), (None, default)):
        _set_env(monkeypatch, attention_triton.CONFIG_ENV, value)
        spy.launches.clear()
        assert generate(model, prompt, fused=True, **kw).tokens == want
        assert spy.launches and set(spy.launches) == {launch}


def test_benchmark_variants_set_and_restore_the_environment(monkeypatch):
    """``comfy_e2e.py --variants``: the form is read or refused naming it, and a row's variables
    hold while it runs and are restored after (also those that were set before)."""
    from benchmarks.comfy_e2e import launches, parse_variant

    value = "quant:4096x12288=32,256,2,4/4;quant:12352x4096=/2"
    assert parse_variant(f"down2:{ENV}={value}|QWEN35_FAST_L2_PREFETCH_KB=0") == (
        "down2", {ENV: value, "QWEN35_FAST_L2_PREFETCH_KB": "0"})
    for bad in ("down2", f":{ENV}=x", f"a b:{ENV}=x", "down2:HOME=/", f"down2:{ENV}"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME:VAR=VALUE"):
            parse_variant(bad)
    monkeypatch.setenv("QWEN35_FAST_L2_PREFETCH_KB", "4096")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("QWEN35_FAST_PDL", raising=False)
    with launches("pack-plain", {ENV: value, "QWEN35_FAST_L2_PREFETCH_KB": "0"}):
        assert (os.environ[ENV], os.environ["QWEN35_FAST_L2_PREFETCH_KB"], os.environ["QWEN35_FAST_PDL"]) == (
            value, "0", "0")
    assert ENV not in os.environ and "QWEN35_FAST_PDL" not in os.environ
    assert os.environ["QWEN35_FAST_L2_PREFETCH_KB"] == "4096"


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
