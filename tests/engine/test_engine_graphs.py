"""CUDA-graph decode/draft/verify steps give the same tokens as eager steps (GPU only).

Also the graph gate itself (CPU): a model that is not entirely on the execution device, or a
backend that syncs with the host, runs eagerly and says why.
"""

import pytest
import torch
from qwen35_fast.engine import bind, generate
from qwen35_fast.engine.errors import Qwen35Error
from qwen35_fast.engine.graphs import graph_blocker

from tests.oracles.tiny import add_mtp, engine_model, make_tiny

gpu = pytest.mark.gpu  # skipped where conftest.gpu_reason() says the GPU kernels cannot run


def _model(tmp_path, seed, device, dtype=torch.float32):
    sd, d = make_tiny(seed, strength=0.3, vocab_size=64, hidden_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    sd = add_mtp(sd, d, seed + 1)
    return engine_model(sd, tmp_path, dtype=dtype, device=device), d


def test_graph_gate_on_cpu(tmp_path, test_seed):
    model, _ = _model(tmp_path, test_seed % 1000, "cpu")
    b = bind(model)
    assert "CUDA device" in graph_blocker(b, torch.device("cpu"), torch.float32, "auto")
    prompt = torch.randn(5, 128)
    with pytest.raises(Qwen35Error, match="cuda_graphs=True"):
        generate(model, prompt, max_length=2, cuda_graphs=True, mtp="off")
    with pytest.raises(Qwen35Error, match="cuda_graphs"):
        generate(model, prompt, max_length=2, cuda_graphs="yes")


@gpu
def test_graph_gate_on_gpu(tmp_path, test_seed):
    model, _ = _model(tmp_path, test_seed % 1000, "cuda")
    b = bind(model)
    dev = torch.device("cuda")
    assert graph_blocker(b, dev, torch.float32, "auto") is None
    assert "syncs with the host" in graph_blocker(b, dev, torch.float32, "torch")
    model.model.layers[0].mlp.to("cpu")  # a partially offloaded model must not be captured
    assert "lives on cpu" in graph_blocker(b, dev, torch.float32, "auto")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_steps_equal_eager(tmp_path, dtype, test_seed):
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda", dtype)
    prompt = torch.randn(1, 23, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    prompt = prompt.to(dtype)
    for mtp in ("off", 1, 3, 5):
        eager = generate(model, prompt, do_sample=False, max_length=40, stop_tokens=[], mtp=mtp, cuda_graphs=False)
        graph = generate(model, prompt, do_sample=False, max_length=40, stop_tokens=[], mtp=mtp, cuda_graphs=True)
        assert graph.tokens == eager.tokens, (mtp, seed)
        if mtp != "off":
            assert graph.stats.accepted == eager.stats.accepted
    off = generate(model, prompt, do_sample=False, max_length=40, stop_tokens=[], mtp="off", cuda_graphs=True)
    on = generate(model, prompt, do_sample=False, max_length=40, stop_tokens=[], mtp=3, cuda_graphs=True)
    assert on.tokens == off.tokens and on.stats.accepted > 0
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5, seed=seed,
              max_length=30, stop_tokens=[], mtp=3)
    assert (generate(model, prompt, cuda_graphs=True, **kw).tokens
            == generate(model, prompt, cuda_graphs=False, **kw).tokens)


@gpu
def test_graph_steps_capture_the_output_projection(tmp_path, test_seed, monkeypatch):
    """Decode, draft and verify logits come out of the graphs: outside a capture the output
    projection runs only for the prefill's last row, never once per step (with MTP the head's first
    catch-up over the prompt rows runs in decode-row pieces, ``speculative.draft``, its draft's
    logits in a graph too)."""
    from qwen35_fast.engine import graphs
    from qwen35_fast.engine.binding import Qwen35Binding

    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    prompt = torch.randn(1, 23, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    capturing, eager_rows = [], []
    real_capture, real_logits = graphs.GraphRunner._capture, Qwen35Binding.logits

    def capture(self, kind, inputs):
        capturing.append(kind)
        try:
            return real_capture(self, kind, inputs)
        finally:
            capturing.pop()

    def logits(self, h, **kw):
        if not capturing:
            eager_rows.append(h.shape[1])
        return real_logits(self, h, **kw)

    for mtp in ("off", 3):  # the trial steps (stack.trial_step: once per process and row counts) first
        generate(model, prompt, do_sample=False, max_length=8, stop_tokens=[], mtp=mtp)
    monkeypatch.setattr(graphs.GraphRunner, "_capture", capture)
    monkeypatch.setattr(Qwen35Binding, "logits", logits)
    for mtp, expected in (("off", [1]), (3, [1])):
        eager_rows.clear()
        out = generate(model, prompt, do_sample=False, max_length=40, stop_tokens=[], mtp=mtp, cuda_graphs=True)
        assert len(out.tokens) == 40 and out.stats.steps > 10
        assert eager_rows == expected, mtp


@gpu
def test_graph_interrupt_then_reuse(tmp_path, test_seed):
    model, d = _model(tmp_path, test_seed % 1000, "cuda")
    prompt = torch.randn(1, 9, d["hidden_size"], device="cuda")
    first = generate(model, prompt, do_sample=False, max_length=30, stop_tokens=[], mtp=2)

    def stop(all_tokens, new, stats):
        if len(all_tokens) > 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, prompt, do_sample=False, max_length=30, stop_tokens=[], mtp=2, callback=stop)
    assert generate(model, prompt, do_sample=False, max_length=30, stop_tokens=[], mtp=2).tokens == first.tokens


@gpu
def test_fused_path_equals_torch_path_gpu(tmp_path, test_seed):
    """float32 on the GPU: the fused kernels give the torch path's tokens, MTP off and on, with and
    without graphs; fused='auto' picks them on CUDA."""
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    prompt = torch.randn(1, 17, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    from qwen35_fast.engine.fused import FusedPlan

    assert FusedPlan.build(bind(model), "cuda", torch.float32)[0] is not None
    for mtp in ("off", 3):
        kw = dict(do_sample=False, max_length=40, stop_tokens=[], mtp=mtp)
        plain = generate(model, prompt, fused=False, cuda_graphs=False, **kw)
        for graphs in (False, True):
            fused = generate(model, prompt, fused=True, cuda_graphs=graphs, **kw)
            assert fused.tokens == plain.tokens, (mtp, graphs, seed)
            if mtp != "off":
                assert fused.stats.accepted == plain.stats.accepted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_depth_switches_in_graphs(tmp_path, dtype, test_seed, monkeypatch):
    """``mtp="auto"`` through deep drafting, plain segments (the ``main+tokenh`` graph keeping each
    step's hidden state for the head's catch-up) and back, with graphs: the MTP-off tokens. The
    depths follow the CPU tests' stand-in cycle costs: with this tiny model's real costs (launch
    bound) depth 1 can rightly beat plain steps even when no draft is kept."""
    from qwen35_fast.engine import generation

    from tests.engine.test_mtp_auto import StandIn, phased_hook

    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(0.2))
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda", dtype)
    prompt = torch.randn(1, 23, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    prompt = prompt.to(dtype)
    off = generate(model, prompt, do_sample=False, max_length=160, stop_tokens=[], mtp="off", cuda_graphs=True)
    for graphs in (True, False):
        res = generate(model, prompt, do_sample=False, max_length=160, stop_tokens=[], mtp="auto",
                       cuda_graphs=graphs, mtp_draft=phased_hook(off.tokens, d["vocab_size"], seed=3))
        assert res.tokens == off.tokens, graphs
        assert 0 in res.stats.mtp_depths and max(res.stats.mtp_depths) >= 3, res.stats.mtp_depths


@gpu
@pytest.mark.parametrize("fused", [False, True])
def test_bucketed_attention_graphs_equal_eager(tmp_path, test_seed, monkeypatch, caplog, fused):
    """The path without Triton's attention: the bucketed backend in CUDA graphs (the module path, and
    the fused one) gives the eager torch path's tokens in float32, MTP off and on, over a generation
    that crosses several spans (a bucket of 16 slots here), with NaN in every unfilled slot."""
    import logging

    from qwen35_fast.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "BUCKET", 16)
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    prompt = torch.randn(1, 23, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    caplog.set_level(logging.INFO, logger="qwen35_fast.engine.graphs")
    for mtp in ("off", 3):
        kw = dict(do_sample=False, max_length=60, stop_tokens=[], mtp=mtp, cache_fill=float("nan"))
        eager = generate(model, prompt, fused=False, cuda_graphs=False, attention="torch", **kw)
        caplog.clear()
        graph = generate(model, prompt, fused=fused, cuda_graphs=True, attention="bucket", **kw)
        assert graph.tokens == eager.tokens, (mtp, fused, seed)
        spans = {r.getMessage().rsplit("over ", 1)[1] for r in caplog.records if "attention over" in r.getMessage()}
        assert len(spans) >= 3, spans  # 23 + 60 slots: spans 32, 48, 64, 80, 96


@gpu
def test_module_path_captures_comfy_style_casts(tmp_path, test_seed):
    """Without the fused kernels the whole module path is captured, also where a module casts its
    weight per call (here every Linear is called in float32 with bf16 weights, as ComfyUI's cast
    does): the graphs' tokens equal the eager module path's."""
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.data = mod.weight.data.to(torch.bfloat16)
            mod.forward = lambda x, m=mod: torch.nn.functional.linear(x, m.weight.to(x.dtype), m.bias)
    prompt = torch.randn(1, 17, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    kw = dict(do_sample=False, max_length=40, stop_tokens=[], fused=False, execution_dtype=torch.float32)
    for mtp in ("off", 3):
        eager = generate(model, prompt, mtp=mtp, cuda_graphs=False, **kw)
        graph = generate(model, prompt, mtp=mtp, cuda_graphs=True, **kw)
        assert graph.tokens == eager.tokens, mtp


def test_a_failed_capture_runs_eagerly_and_says_so(tmp_path, test_seed, monkeypatch, caplog):
    """A step whose capture raises (a module call that cannot be captured) runs eagerly, with the same
    outputs, said once, and is not tried again in this process on this path (a second runner);
    with cuda_graphs=True the error propagates."""
    import logging

    from qwen35_fast.engine import graphs
    from qwen35_fast.engine.cache import ModelCache
    from qwen35_fast.engine.forward import Runner

    model, d = _model(tmp_path, test_seed % 1000, "cpu")
    b = bind(model)
    tried = []

    def fail(self, kind, inputs):
        tried.append((kind, inputs[0].shape[1]))
        raise RuntimeError("cuBLAS error: 14 [test]")

    monkeypatch.setattr(graphs.GraphRunner, "_capture", fail)
    monkeypatch.setattr(graphs, "_CAPTURE_FAILED", {})
    x = torch.randn(1, 1, d["hidden_size"])
    pos = torch.zeros(3, 1, dtype=torch.int64)

    def runner():
        cache = ModelCache(b.config, batch=1, capacity=8, dtype=torch.float32, device="cpu")
        return Runner(b, cache, dtype=torch.float32, device="cpu", attention="torch")

    expect = runner().forward_logits(x, pos)[2]
    caplog.set_level(logging.WARNING)
    for g in (graphs.GraphRunner(runner()), graphs.GraphRunner(runner())):
        for _ in range(2):
            assert torch.equal(g.forward_logits(x, pos)[2], expect)
            g.cache.discard()
    assert tried == [("main+logits", 1)]
    warned = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert len(warned) == 1 and "main+logits 1-row step failed (RuntimeError: cuBLAS error: 14" in warned[0]
    failed = graphs._CAPTURE_FAILED[graphs.failure_key(torch.device("cpu"), torch.float32, "torch")]
    assert list(failed) == [("main+logits", 1)] and failed[("main+logits", 1)] in warned[0]
    with pytest.raises(RuntimeError, match="cuBLAS error"):
        graphs.GraphRunner(runner(), required=True).forward_logits(torch.randn(1, 2, d["hidden_size"]),
                                                                   torch.zeros(3, 2, dtype=torch.int64))


@gpu
def test_a_failed_capture_keeps_the_rest_in_graphs_and_the_rng_usable(tmp_path, test_seed, monkeypatch, caplog):
    """A module whose call syncs with the host when it gets several rows (as comfy-kitchen 0.2.24's
    int8 product fails to capture at some shapes): the verify steps run eagerly, the 1-row steps stay
    in graphs, the tokens equal the eager run's, and the CUDA random generator still draws."""
    import logging

    from qwen35_fast.engine import graphs

    monkeypatch.setattr(graphs, "_CAPTURE_FAILED", {})
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    down = model.model.layers[2].mlp.down_proj
    plain = down.forward

    def syncing(x):
        if x.shape[1] > 1:
            float(x.sum())  # a host sync: not allowed while a stream is captured
        return plain(x)

    down.forward = syncing
    prompt = torch.randn(1, 17, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    caplog.set_level(logging.INFO, logger="qwen35_fast.engine.graphs")
    kw = dict(do_sample=False, max_length=30, stop_tokens=[], mtp=3, fused=False)  # the module path
    eager = generate(model, prompt, cuda_graphs=False, **kw)
    graph = generate(model, prompt, cuda_graphs="auto", **kw)
    assert graph.tokens == eager.tokens
    messages = [r.getMessage() for r in caplog.records]
    assert any("4-row step failed" in m for m in messages), messages
    assert any("captured the mtp" in m for m in messages)  # the head's 1-row steps: still graphs
    assert torch.randn(8, device="cuda").isfinite().all()
    with pytest.raises(Qwen35Error, match="cuda_graphs=True but capturing the main\\+logits 4-row step failed"):
        generate(model, prompt, cuda_graphs=True, **kw)


def test_bucketed_graphs_are_kept_per_span(tmp_path, test_seed, monkeypatch):
    """A bucketed backend's graphs are keyed by span (the filled slots after the step, rounded up to
    a bucket); a new span drops the same kind's graphs more than one bucket away from it (an MTP
    rollback can cross back one bucket edge, never two; a kept stack's next generation starts
    lower, and the spans above are dropped then)."""
    from qwen35_fast.engine import graphs
    from qwen35_fast.engine.cache import ModelCache
    from qwen35_fast.engine.forward import Runner
    from qwen35_fast.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "BUCKET", 4)
    model, d = _model(tmp_path, test_seed % 1000, "cpu")
    b = bind(model)
    cache = ModelCache(b.config, batch=1, capacity=40, dtype=torch.float32, device="cpu")
    assert [cache.span("main", r) for r in (1, 4, 5)] == [4, 4, 8]
    g = graphs.GraphRunner(Runner(b, cache, dtype=torch.float32, device="cpu", attention="bucket"))
    seen = []
    for span in (4, 4, 8, 12, 16, 8):
        g._keep(("main", 1, span), graphs._Graph(None, [], (), None))
        g._keep(("mtp", 1, 4), graphs._Graph(None, [], (), None))  # another kind: kept
        seen.append(sorted(k[2] for k in g._graphs if k[0] == "main"))
    assert seen == [[4], [4], [4, 8], [8, 12], [12, 16], [8, 12]]
    assert ("mtp", 1, 4) in g._graphs


def test_a_failed_int8_call_is_rerouted_and_captured_again(monkeypatch, caplog):
    """When a capture fails inside a module call of several rows over an int8 weight, that weight
    shape's several-row products go to ``int8_rows`` and the capture is tried again (each new shape
    once, at most ``REROUTES``); a failure elsewhere, or of a 1-row step, is not rerouted; the
    shapes a capture that still fails rerouted are taken back."""
    import logging
    import types

    from qwen35_fast.engine import graphs

    bad = {"down": (16, 512), "fc": (8, 256)}  # module -> its int8 weight shape, whose call fails
    runner = types.SimpleNamespace(failed_module=None, int8_shapes=set(),
                                   int8_weight=lambda m: None if m == "norm" else types.SimpleNamespace(
                                       weight=torch.empty(bad[m], dtype=torch.int8)))
    order = []

    def capture(self, kind, inputs):
        for module in order:
            if module == "norm" or bad[module] not in runner.int8_shapes:
                runner.failed_module = module
                raise RuntimeError(f"cuBLAS error: 14 [{module}]")
        return graphs._Graph(None, [], (), None)

    monkeypatch.setattr(graphs.GraphRunner, "_capture", capture)
    g = object.__new__(graphs.GraphRunner)
    g.runner, g.required = runner, False
    caplog.set_level(logging.WARNING)
    four = (torch.zeros(1, 4, 8),)
    order[:] = ["down", "fc"]
    assert isinstance(g._capture_or_reroute("main+logits", four), graphs._Graph)
    assert runner.int8_shapes == {(16, 512), (8, 256)}
    assert sum("16x512 cannot be captured" in r.getMessage() for r in caplog.records) == 1
    order[:] = ["norm"]
    assert isinstance(g._capture_or_reroute("main+logits", four), RuntimeError)
    runner.int8_shapes.clear()
    order[:] = ["down"]
    assert isinstance(g._capture_or_reroute("main+token", (torch.zeros(1, 1, 8),)), RuntimeError)  # 1 row
    assert runner.int8_shapes == set()
    bad.update({f"m{i}": (8 * (i + 3), 256) for i in range(graphs.REROUTES + 1)})
    order[:] = [f"m{i}" for i in range(graphs.REROUTES + 1)]
    assert isinstance(g._capture_or_reroute("main+logits", four), RuntimeError)
    assert runner.int8_shapes == set()  # still failing after REROUTES shapes: all taken back
    order[:] = ["down", "norm"]  # rerouting down does not help: taken back, the eager step calls the module
    assert isinstance(g._capture_or_reroute("main+logits", four), RuntimeError)
    assert runner.int8_shapes == set()


def test_the_module_path_routes_rerouted_int8_rows(tmp_path, test_seed):
    """``Runner._lin``: a product of several rows whose int8 weight shape was rerouted goes to
    ``int8_rows`` (the weight the hook reads in place); one row, or another shape, calls the module;
    a module call that raises is remembered for the GraphRunner."""
    from qwen35_fast.engine.cache import ModelCache
    from qwen35_fast.engine.forward import Runner
    from qwen35_fast.engine.int8_rows import int8_rows
    from qwen35_fast.engine.plain_weights import PlainLinear

    model, d = _model(tmp_path, test_seed % 1000, "cpu")
    b = bind(model)
    lin = b.layers[0].mlp.down_proj
    q = torch.randint(-127, 128, tuple(lin.weight.shape), dtype=torch.int8)
    plain = PlainLinear(q, scale=torch.rand(q.shape[0]) / 100)

    class Hook(type(b.weights)):
        def linear(self, module, device, dtype):
            return (plain, None) if module is lin else (None, "not int8")

    b.weights = Hook()
    cache = ModelCache(b.config, batch=1, capacity=8, dtype=torch.float32, device="cpu")
    runner = Runner(b, cache, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 3, q.shape[1])
    assert torch.equal(runner._lin(lin, x), lin(x))  # nothing rerouted yet
    runner.int8_shapes.add(tuple(q.shape))
    assert torch.equal(runner._lin(lin, x), int8_rows(x, plain))
    assert torch.equal(runner._lin(lin, x[:, :1]), lin(x[:, :1]))  # one row: the module
    gate = b.layers[0].mlp.gate_proj
    assert torch.equal(runner._lin(gate, torch.ones(1, 3, gate.weight.shape[1])),
                       gate(torch.ones(1, 3, gate.weight.shape[1])))
    with pytest.raises(RuntimeError):
        runner._lin(lin, torch.randn(1, 1, 7))  # the module call raises
    assert runner.failed_module is lin


@gpu
@pytest.mark.parametrize("fused", [False, True])
def test_kept_graphs_serve_the_next_prompt(tmp_path, test_seed, fused):
    """The stack kept from one generation (``engine/held.py``) replays its graphs for the next
    prompt without capturing them again, with the tokens of a fresh eager run; at rest it pins no
    weight (moving the model off the GPU frees all of it); after the move it is rebuilt; released,
    its cache's memory is freed."""
    import gc

    from qwen35_fast.engine import held

    held.release_all()
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    g = torch.Generator("cuda").manual_seed(seed)
    p1, p2 = (torch.randn(1, n, d["hidden_size"], device="cuda", generator=g) for n in (23, 31))
    kw = dict(do_sample=False, max_length=40, stop_tokens=[], mtp=3, fused=fused)
    generate(model, p1, **kw)
    (runner,) = held.kept_stacks()
    first = dict(runner._graphs)
    second = generate(model, p2, **kw)
    assert "kept from the last generation" in second.stats.decode_path
    assert ("main+logits", 4) in {k[:2] for k in first} and all(runner._graphs[k] is v for k, v in first.items())
    assert second.tokens == generate(model, p2, cuda_graphs=False, cache_fill=float("nan"), **kw).tokens
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated()
    model.to("cpu")
    gc.collect()
    assert torch.cuda.memory_allocated() <= resting - weights  # nothing of the weights stayed pinned
    model.to("cuda")
    third = generate(model, p2, **kw)
    assert "kept" not in third.stats.decode_path and third.tokens == second.tokens
    cache = sum(t.numel() * t.element_size() for t in held._walk_tensors(held.kept_stacks()[0].cache))
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated()
    assert held.release_all() == 1
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= kept - cache


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subset_drafts_in_graphs(tmp_path, dtype, test_seed, monkeypatch):
    """Drafts over the first 37 of 64 ids (an odd row count for the output GEMV), fused, with and
    without graphs: MTP off's tokens, and no draft at or above the cut; the draft steps were
    captured as their own graphs (``mtp+logits/37``)."""
    import qwen35_fast.engine.binding as binding_module
    from qwen35_fast.engine import generation

    from tests.engine.test_draft_vocab import _drafts_seen

    monkeypatch.setattr(binding_module, "draft_ids", lambda vocab_size: 37)
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda", dtype)
    prompt = torch.randn(1, 19, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    kw = dict(do_sample=False, max_length=48, stop_tokens=[], fused=True)
    off = generate(model, prompt.to(dtype), mtp="off", **kw)
    seen = _drafts_seen(monkeypatch)
    captured = []
    real = generation.build_runner

    def keep(*a, **k):
        runner = real(*a, **k)
        captured.append(runner)
        return runner
    monkeypatch.setattr(generation, "build_runner", keep)
    for graphs in (False, True):
        seen.clear()
        res = generate(model, prompt.to(dtype), mtp=3, draft_vocab="subset", cuda_graphs=graphs, **kw)
        assert res.tokens == off.tokens, graphs
        assert seen and max(seen) < 37, (graphs, sorted(set(seen)))
    kinds = {key[0] for key in getattr(captured[-1], "_graphs", {})}
    assert {"mtp+logits/37", "mtp+row/37"} <= kinds, kinds


@gpu
@pytest.mark.parametrize("sampled", [False, True])
def test_a_thinking_budget_gives_the_torch_paths_tokens_gpu(tmp_path, test_seed, monkeypatch, sampled):
    """float32 on the GPU with a thinking budget of 20 (close ids the model does not write itself): the
    fused kernels with and without graphs give the torch path's tokens MTP off, at depth 3 and under
    ``mtp="auto"`` switching depths, and the budget cut the thinking in every run."""
    from qwen35_fast.engine import ThinkingBudget, generation

    from tests.engine.test_mtp_auto import StandIn

    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(0.2))
    seed = test_seed % 1000
    model, d = _model(tmp_path, seed, "cuda")
    prompt = torch.randn(1, 19, d["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    sampling = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5, seed=seed) \
        if sampled else dict(do_sample=False)
    free = generate(model, prompt, max_length=40, stop_tokens=[], mtp="off", fused=False, cuda_graphs=False,
                    **sampling)
    end = next(t for t in range(d["vocab_size"]) if t not in free.tokens)
    budget = ThinkingBudget(20, ((end + 1) % d["vocab_size"], end), end)
    for mtp in ("off", 3, "auto"):
        kw = dict(max_length=40, stop_tokens=[], mtp=mtp, thinking_budget=budget, **sampling)
        plain = generate(model, prompt, fused=False, cuda_graphs=False, **kw)
        assert plain.tokens[20:22] == list(budget.close) and plain.stats.thinking_cut
        for graphs in (False, True):
            fused = generate(model, prompt, fused=True, cuda_graphs=graphs, **kw)
            assert fused.tokens == plain.tokens, (mtp, graphs, seed)
