"""The fused decode path (Triton kernels, through the interpreter on CPU) against the torch path:
same hidden states for 1 and 4 rows, same states after a partial commit, same greedy tokens with
and without MTP; and the plan refuses modules it does not know, naming them."""

import logging

import pytest
import torch
from qwen35_fast.engine import bind, generate
from qwen35_fast.engine.cache import DeltaNetState, ModelCache
from qwen35_fast.engine.errors import Qwen35Error
from qwen35_fast.engine.forward import Runner
from qwen35_fast.engine.fused import FusedPlan
from qwen35_fast.engine.fused_parts import Deferred
from qwen35_fast.kernels import interpreting
from qwen35_fast.patches.comfy_weights import Resolver

from tests.oracles.tiny import add_mtp, engine_model, make_tiny

# The CPU runs the kernels through the Triton interpreter (conftest sets it up without CUDA; on a
# CUDA machine run this file with TRITON_INTERPRET=1); tests/engine/test_engine_graphs.py compares the two
# paths on the GPU.
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU interpreter tests: set TRITON_INTERPRET=1")


@pytest.fixture
def model(tmp_path, test_seed):
    seed = test_seed % 10_000
    sd, d = make_tiny(seed, strength=0.3, vocab_size=64, hidden_size=64, num_hidden_layers=4)
    sd = add_mtp(sd, d, seed + 1)
    return engine_model(sd, tmp_path), d


def _runners(model, prompt):
    """Two runners (torch path, fused path) on two caches prefilled with the same prompt."""
    b = bind(model)
    plan, why = FusedPlan.build(b, "cpu", torch.float32)
    assert plan is not None, why
    # every layer norm's factor goes to the projections that read it (the final norms keep theirs)
    layers = [f"layers.{i}" for i in range(b.config.num_hidden_layers)] + ["mtp.layers.0"]
    assert plan.deferred == {f"{p}.{n}" for p in layers for n in ("input_layernorm", "post_attention_layernorm")}
    out = []
    for fused in (None, plan):
        cache = ModelCache(b.config, batch=1, capacity=64, dtype=torch.float32, device="cpu", mtp=True)
        r = Runner(b, cache, dtype=torch.float32, device="cpu", attention="triton", fused=fused)
        t = prompt.shape[1]
        pos = torch.arange(t).expand(3, t)
        r.forward(prompt, pos, keep_rows=False)
        cache.commit()
        r.mtp_forward(prompt, prompt, pos)
        cache.mtp.commit()
        out.append(r)
    return out


def _states(cache):
    return [(x.recurrent.clone(), x.conv.clone()) if isinstance(x, DeltaNetState) else (x.length.clone(), x.host_length)
            for x in cache.layers]


@pytest.fixture(params=["unsplit", "split-K"])
def split(request, monkeypatch):
    """The products as ``kernels.gemv`` picks them, or the outputs that feed a norm split over K
    (3 ranges of 32-wide tiles, so a 64- or 96-wide K gives 2 or 3 float32 partials) and the norms
    cut into 16-column programs."""
    if request.param == "split-K":
        from qwen35_fast.kernels import launch, norms

        monkeypatch.setattr(launch, "gemv", lambda n, k, quant, rows, device, **kw: ((16, 32, 4, 2), 3))
        monkeypatch.setattr(norms, "NORM_SLICE", 16)  # 4 programs a row: 4 partial sums of squares
    return request.param


def test_fused_rows_match_torch_path(model, rng, split):
    model, d = model
    prompt = torch.randn(1, 11, d["hidden_size"], generator=rng)
    plain, fused = _runners(model, prompt)
    t = prompt.shape[1]
    for rows, keep in ((1, 1), (4, 2), (4, 4), (3, 1), (2, 2)):
        x = torch.randn(1, rows, d["hidden_size"], generator=rng)
        length = plain.cache.length
        pos = torch.arange(length, length + rows).expand(3, rows)
        got = fused.forward(x, pos)
        want = plain.forward(x, pos)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
        if rows == 3:  # the last row's state is in place: dropping every row is refused, nothing applied
            with pytest.raises(Qwen35Error, match="at least its first row"):
                fused.cache.commit(0)
        plain.cache.commit(keep)
        fused.cache.commit(keep)
        for (g1, g2), (w1, w2) in zip(_states(fused.cache), _states(plain.cache)):
            if isinstance(g2, int):
                assert torch.equal(g1, w1) and g2 == w2
            else:
                torch.testing.assert_close(g1, w1, atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(g2, w2, atol=2e-5, rtol=2e-5)
    # the MTP head: 2 catch-up rows then one draft row
    for rows in (2, 1):
        h = torch.randn(1, rows, d["hidden_size"], generator=rng)
        e = torch.randn(1, rows, d["hidden_size"], generator=rng)
        pos = torch.arange(t, t + rows).expand(3, rows)
        torch.testing.assert_close(fused.mtp_forward(h, e, pos), plain.mtp_forward(h, e, pos), atol=2e-5, rtol=2e-5)
        fused.cache.mtp.commit()
        plain.cache.mtp.commit()


def test_deferred_norm_output_read_by_a_module(model, rng):
    """A layer norm's deferred output (``FusedPlan.norm``) that reaches a projection not read in
    place is the norm's output itself: equal to the layer's own norm module, then the module."""
    model, d = model
    b = bind(model)
    plan, why = FusedPlan.build(b, "cpu", torch.float32)
    assert plan is not None, why
    x, res = (torch.randn(1, 2, d["hidden_size"], generator=rng) for _ in range(2))
    xn, h = plan.norm("layers.0.input_layernorm", x, res)
    assert isinstance(xn, Deferred)
    lin = torch.nn.Linear(d["hidden_size"], 5)
    (got,) = plan.lins([lin], xn)
    want = lin(b.layers[0].input_layernorm(x + res))
    torch.testing.assert_close(h, x + res)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mtp", ["off", 3])
def test_fused_generation_equals_torch_path(model, rng, mtp):
    model, d = model
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=16, stop_tokens=[], mtp=mtp, attention="torch")
    fused = generate(model, prompt, fused=True, **kw)
    plain = generate(model, prompt, fused=False, **kw)
    assert fused.tokens == plain.tokens
    if mtp != "off":
        assert fused.stats.accepted == plain.stats.accepted and fused.stats.accepted > 0


def test_greedy_step_draws_the_argmax_of_the_logits_step(model, rng):
    """``forward_token`` (embedding, step, output projection and ``kernels.argmax`` in one call)
    against ``forward_logits`` plus torch's argmax on a twin cache: the same token every step, the
    same cache after it, and the token written over the ids it was given."""
    model, d = model
    prompt = torch.randn(1, 11, d["hidden_size"], generator=rng)
    twins = _runners(model, prompt)[1], _runners(model, prompt)[1]  # two fused runners, same prompt
    ids = torch.tensor([[3]])
    want_ids = ids.clone()
    for _ in range(5):
        length = twins[0].cache.length
        pos = torch.arange(length, length + 1).expand(3, 1)
        x = twins[1].binding.embed(want_ids, torch.float32, "cpu")
        _, _, logits = twins[1].forward_logits(x, pos)
        want = logits.view(1, -1).argmax(dim=-1)
        got = twins[0].forward_token(ids, pos)
        assert got.data_ptr() == ids.data_ptr() and torch.equal(got, want)
        for r in twins:
            r.cache.commit()
        for (g1, g2), (w1, w2) in zip(_states(twins[0].cache), _states(twins[1].cache)):
            assert torch.equal(g1, w1) and (g2 == w2 if isinstance(g2, int) else torch.equal(g2, w2))
        want_ids = want.view(1, 1)
    with pytest.raises(ValueError, match=r"int64 ids \[1, 1\]"):
        twins[0].forward_token(torch.tensor([[1, 2]]), pos)


def test_greedy_step_takes_strided_logits(model, rng, monkeypatch):
    """Logits whose last dim is strided (a module output the pack does not control) reach torch's
    argmax instead of the kernel, which needs a contiguous row: the same token, no error."""
    model, d = model
    prompt = torch.randn(1, 7, d["hidden_size"], generator=rng)
    twins = _runners(model, prompt)[1], _runners(model, prompt)[1]
    real = twins[0].binding.logits
    monkeypatch.setattr(twins[0].binding, "logits",
                        lambda h, **kw: torch.stack([real(h, **kw)] * 2, dim=-1)[..., 0])
    pos = torch.arange(twins[1].cache.length, twins[1].cache.length + 1).expand(3, 1)
    _, _, logits = twins[1].forward_logits(twins[1].binding.embed(torch.tensor([[5]]), torch.float32, "cpu"), pos)
    got = twins[0].forward_token(torch.tensor([[5]]), pos)
    assert torch.equal(got, logits.view(1, -1).argmax(dim=-1))


def test_greedy_loop_takes_the_token_step_unless_stops_are_masked(model, rng, monkeypatch):
    """Greedy MTP-off decoding draws each token in the step itself (``forward_token``) and gives
    the logits path's tokens; while ``min_tokens`` forbids stop tokens it takes the logits path,
    whose rows it masks."""
    model, d = model
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    calls = []
    for name in ("forward_token", "forward_logits"):
        real = getattr(Runner, name)
        monkeypatch.setattr(Runner, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    kw = dict(do_sample=False, max_length=8, mtp="off", attention="torch", fused=True)
    free = generate(model, prompt, stop_tokens=[], **kw)
    assert calls == ["forward_token"] * 7  # the first token comes from the prompt's logits
    calls.clear()
    held = generate(model, prompt, stop_tokens=[free.tokens[0]], min_tokens=4, **kw)
    # tokens 1..3 are drawn while stops are forbidden; a stop token leaves one launched step unused
    assert calls[:3] == ["forward_logits"] * 3 and set(calls[3:]) == {"forward_token"}
    assert len(calls) in (len(held.tokens) - 1, len(held.tokens)) and len(held.tokens) > 4
    monkeypatch.undo()
    from qwen35_fast.engine import sampling

    monkeypatch.setattr(sampling.Sampler, "masks", lambda self, first_count: True)  # the logits path only
    assert generate(model, prompt, stop_tokens=[], **kw).tokens == free.tokens


def test_fused_decode_reads_the_embedding_table_in_place(model, rng):
    """With the fused plan, a decode step looks up its token in the embedding table the plan read
    in place (no module call per token); without it, the module is called. Same tokens."""
    model, d = model
    emb = model.model.embed_tokens
    calls = []
    hook = emb.register_forward_hook(lambda mod, args, out: calls.append(1))
    prompt = torch.randn(1, 9, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=6, stop_tokens=[], mtp="off", attention="torch")
    try:
        fused = generate(model, prompt, fused=True, **kw)
        assert calls == []
        plain = generate(model, prompt, fused=False, **kw)
        assert len(calls) >= 5
    finally:
        hook.remove()
    assert fused.tokens == plain.tokens


def test_plan_refuses_unknown_modules(model, rng):
    model, d = model
    b = bind(model)
    layer = model.model.layers[1]
    original = layer.input_layernorm
    layer.input_layernorm = torch.nn.RMSNorm(d["hidden_size"], eps=1e-6)
    try:
        plan, why = FusedPlan.build(b, "cpu", torch.float32)
        assert plan is None and "layers.1.input_layernorm" in why and "RMSNorm" in why
        with pytest.raises(Qwen35Error, match="fused=True but layers.1.input_layernorm"):
            generate(model, torch.randn(1, 3, d["hidden_size"]), max_length=2, mtp="off", fused=True)
    finally:
        layer.input_layernorm = original
    comfy = bind(model, weights=Resolver())  # how the ComfyUI layer binds
    original.comfy_cast_weights = True  # the flag ComfyUI writes on every loaded module says nothing
    try:
        assert FusedPlan.build(comfy, "cpu", torch.float32)[0] is not None
        original.weight_function = [lambda w: w]  # a per-call weight patch (a LoRA): the modules must run
        plan, why = FusedPlan.build(comfy, "cpu", torch.float32)
        assert plan is None and "layers.1.input_layernorm" in why and "per-call weight patches" in why
    finally:
        del original.comfy_cast_weights
        del original.weight_function
    assert FusedPlan.build(b, "cpu", torch.float32)[0] is not None
    with pytest.raises(Qwen35Error, match="fused must be"):
        generate(model, torch.randn(1, 3, d["hidden_size"]), max_length=2, fused="yes")


def test_plan_refuses_a_conv_wider_than_the_step_kernel_keeps(tmp_path, test_seed):
    """A DeltaNet conv of 5 taps (the fused step keeps 4): no plan, and the reason names the taps,
    also where the caller asked for the fused path."""
    sd, d = make_tiny(test_seed % 10_000, strength=0.3, vocab_size=64, conv_kernel_size=5)
    model = engine_model(sd, tmp_path)
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert plan is None and "conv kernel of 5 taps" in why, why
    with pytest.raises(Qwen35Error, match="conv kernel of 5 taps"):
        generate(model, torch.randn(1, 3, d["hidden_size"]), max_length=2, mtp="off", fused=True)


def test_every_generation_says_its_decode_path(model, caplog):
    """One INFO line per generation names the decode path, with the reason when it is the module path."""
    model, d = model
    x = torch.randn(1, 3, d["hidden_size"])
    caplog.set_level(logging.INFO, logger="qwen35_fast.engine.stack")
    for fused, expect in ((False, "every layer through its module calls (no fused kernels: fused=False)"),
                          ("auto", "(no fused kernels: the fused kernels need a CUDA device (running on cpu))"),
                          (True, "fused kernels, 40 of 40 projections read in place (float32 40), CUDA graphs off"
                                 " (CUDA graphs need a CUDA device (running on cpu)), overlapped launches off (needs a "
                                 "CUDA device"),
                          (False, "(no fused kernels: fused=False)")):
        caplog.clear()
        res = generate(model, x, max_length=2, mtp="off", fused=fused)
        lines = [r.getMessage() for r in caplog.records if "decode path" in r.getMessage()]
        assert len(lines) == 1 and expect in lines[0], (fused, lines)
        short = {False: "module calls (no Triton kernels: fused=False)", True: "Triton kernels",
                 "auto": "module calls (no Triton kernels: the fused kernels need a CUDA device (running on cpu))"}
        assert res.stats.decode_path == short[fused] + ", no CUDA graphs (CUDA graphs need a CUDA device (running "\
                                                       "on cpu))", res.stats.decode_path


def test_the_status_line_names_the_triton_to_install(model, monkeypatch):
    """Where the fused kernels cannot run because Triton is missing (a Windows torch), the stats line
    the nodes show names the decode path and the exact command that installs the matching Triton."""
    from qwen35_fast.engine import stack
    from qwen35_fast.kernels import capabilities
    from qwen35_fast.patches.comfy_bridge import format_stats

    model, d = model
    monkeypatch.setattr(capabilities.sys, "platform", "win32")
    monkeypatch.setattr(capabilities.torch, "__version__", "2.11.0+cu128")
    why = capabilities.unusable_reason(ModuleNotFoundError("No module named 'triton'"))
    monkeypatch.setattr(stack, "fused_plan", lambda fused, binding, device, dtype: (None, why))
    res = generate(model, torch.randn(1, 3, d["hidden_size"]), max_length=2, mtp="off")
    line = format_stats("Qwen3.5", res.stats)
    assert "; module calls (no Triton kernels: Triton is not usable here (ModuleNotFoundError" in line, line
    assert 'pip install "triton-windows<3.7"' in line and line.endswith("(running on cpu))"), line


def test_a_triton_without_overlapped_launches_is_said_once(model, caplog, monkeypatch):
    """A GPU that could overlap its kernels but whose Triton cannot gets one warning naming the fix;
    a GPU that cannot (before Hopper) only the decode-path line."""
    from qwen35_fast.engine import stack

    model, d = model
    x = torch.randn(1, 3, d["hidden_size"])
    caplog.set_level(logging.INFO, logger="qwen35_fast.engine.stack")
    old = "this Triton's launcher takes no launch_pdl (Triton 3.4+ does) [test]"
    monkeypatch.setattr(stack, "triton_pdl_reason", lambda: old)
    for reason, warned in (("needs compute capability 9.0+ (Hopper or newer); this GPU is 8.9 [test]", False),
                           (old, True)):
        monkeypatch.setattr(stack, "pdl_reason", lambda device, r=reason: r)
        caplog.clear()
        generate(model, x, max_length=2, mtp="off", fused=True, cache_fill=0.0)  # a new stack, not the kept one
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("install Triton 3.4 or newer" in w for w in warnings) == warned, warnings
        assert any(f"overlapped launches off ({reason})" in r.getMessage() for r in caplog.records)


def test_each_product_prefetches_the_next_products_weight(model, rng, monkeypatch, tmp_path):
    """Along a decode step (main layers, then the output projection), each product is asked to
    prefetch the weight of the product launched after it into L2, the last none: the oracle is the
    order in which the step actually launches its products, recorded. A mixer's input product (the
    first of each layer's four) asks for the launch table's ``mixer_bytes`` of the mixer's output
    weight (a pinned table's here), the others for the default length."""
    import json

    from qwen35_fast.kernels import gemv, launch

    launched = []
    real_gemv = gemv.gemv_group

    def product(x, weights, **kw):
        launched.append((weights[0], kw.get("prefetch"), kw.get("prefetch_bytes")))
        return real_gemv(x, weights, **kw)

    monkeypatch.setattr(gemv, "gemv_group", product)
    table = tmp_path / "mixer.json"
    table.write_text(json.dumps({"launches": {"prefetch": {"l2 * @*": {"mixer_bytes": 24576 << 10}}}}))
    model, d = model
    with launch.pinned(table):
        _, fused = _runners(model, torch.randn(1, 7, d["hidden_size"], generator=rng))
    fused.binding.plain_output = fused.fused.output  # as engine/stack.py sets it
    assert fused.fused.output is not None
    start = 7
    for rows in (1, 4):
        launched.clear()
        x = torch.randn(1, rows, d["hidden_size"], generator=rng)
        fused.forward_logits(x, torch.arange(start, start + rows).expand(3, rows))
        fused.cache.commit()
        start += rows
        assert len(launched) == 4 * d["num_hidden_layers"] + 1  # mixer in, mixer out, gate/up, down; the output
        for (_, asked, _), (nxt, _, _) in zip(launched, launched[1:]):
            assert asked is nxt, "a product that did not prefetch the next one's weight"
        assert launched[-1][1] is None
        lengths = [nbytes for _, _, nbytes in launched]
        assert lengths == [24576 << 10 if i % 4 == 0 and i < len(launched) - 1 else None
                           for i in range(len(launched))]


class _FailingLaunch:
    """Stands for a Triton kernel that cannot compile here: every launch raises, and is counted."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches += 1
            raise RuntimeError("test: this kernel does not compile here\nsecond line")
        return launch


@pytest.fixture
def on_cuda(monkeypatch):
    """The engine's stack as on a CUDA device ("auto" takes the fused kernels after a trial step),
    with no trial outcome remembered from other tests."""
    from qwen35_fast.engine import stack

    monkeypatch.setattr(stack, "_on_cuda", lambda device: True)
    monkeypatch.setattr(stack, "_TRIED", {})
    return stack


def test_a_fused_path_that_fails_its_trial_step_runs_the_modules_and_says_why(model, rng, caplog, monkeypatch,
                                                                             on_cuda):
    """A kernel that does not compile (as Triton 3.4.0's PDL helpers did not) must not break a
    generation: on a trial step before the prompt, the fused path fails, the generation runs every
    layer through its modules with the same greedy tokens, one warning names the error and the
    versions, and the trial is not repeated for the next generation. With fused=True the failure
    is an error naming it."""
    from qwen35_fast.kernels import gemv

    model, d = model
    x = torch.randn(1, 5, d["hidden_size"], generator=rng)
    want = generate(model, x, do_sample=False, max_length=6, mtp=3, fused=False).tokens
    failing = _FailingLaunch()
    monkeypatch.setattr(gemv, "_gemv_kernel", failing)
    caplog.set_level(logging.INFO, logger="qwen35_fast.engine.stack")
    got = generate(model, x, do_sample=False, max_length=6, mtp=3, fused="auto")
    assert got.tokens == want
    assert failing.launches == 1  # the trial's first product; the generation launched none
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "trial step" in r.getMessage()]
    assert len(warned) == 1 and "RuntimeError: test: this kernel does not compile here" in warned[0], warned
    assert "second line" not in warned[0] and "Triton " in warned[0] and "torch " in warned[0]
    assert any("every layer through its module calls" in r.getMessage() for r in caplog.records)
    assert generate(model, x, do_sample=False, max_length=6, mtp=3, fused="auto").tokens == want
    assert failing.launches == 1
    with pytest.raises(Qwen35Error, match="fused=True but the fused kernels failed on a trial step"):
        generate(model, x, do_sample=False, max_length=6, mtp=3, fused=True)


def test_a_trial_step_runs_once_on_its_own_state(model, monkeypatch, on_cuda):
    """The trial step (1 row and the MTP verify's rows) runs on a cache of its own: the runner's
    cache is untouched after it, the fused path is kept, and the next runner of the same shape
    does not try again."""
    stack = on_cuda
    model, _ = model
    b = bind(model)
    rows = []
    real = Runner.forward_logits

    def spy(self, x, pos):
        rows.append(x.shape[1])
        return real(self, x, pos)

    monkeypatch.setattr(Runner, "forward_logits", spy)
    for _ in range(2):
        runner = stack.build_runner(b, capacity=16, dtype=torch.float32, device="cpu", attention="triton",
                                    mtp=True, cuda_graphs=False, verify_rows=4)
        assert runner.fused is not None
        assert runner.cache.length == 0
        assert all(int(kv.length) == 0 and not kv.staged for kv in runner.cache.layers
                   if not isinstance(kv, DeltaNetState))
        assert all(not st.recurrent.any() and not st.conv.any() for st in runner.cache.layers
                   if isinstance(st, DeltaNetState))
    assert rows == [1, 4] and list(stack._TRIED.values()) == [None]
