"""generate()/bind() surface: callbacks and interrupts, stop tokens, min_tokens, dtypes, bad requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from qwen35_fast.engine import GenerationStats, Qwen35Binding, Qwen35Error, bind, generate


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("kw", [dict(do_sample=False, mtp="off"), dict(do_sample=True, seed=5, mtp=3)])
def test_interrupt_leaves_model_reusable(model, rng, kw):
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    fresh = generate(m, prompt, max_length=30, stop_tokens=[], **kw)

    def interrupt(all_tokens, new, stats):
        if len(all_tokens) >= 9:
            raise Interrupted

    with pytest.raises(Interrupted):
        generate(m, prompt, max_length=30, stop_tokens=[], callback=interrupt, **kw)
    again = generate(m, prompt, max_length=30, stop_tokens=[], **kw)
    assert again.tokens == fresh.tokens
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_callback_stream_and_stats(model, rng):
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    calls = []
    res = generate(m, prompt, do_sample=False, max_length=25, mtp=3, stop_tokens=[],
                   callback=lambda all_tokens, new, stats: calls.append((all_tokens, new, stats.tokens)))
    assert sum((c[1] for c in calls), []) == res.tokens
    assert all(c[0] == res.tokens[:len(c[0])] and c[2] == len(c[0]) for c in calls)
    s = res.stats
    assert isinstance(s, GenerationStats)
    assert s.tokens == 25 and s.steps == len(calls) - 1 and s.mtp_depth == 3
    assert s.prefill_s > 0 and s.decode_s > 0 and s.tok_per_s > 0 and s.attention_backend == "torch"


def test_stop_tokens_and_min_tokens(model, rng):
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    plain = generate(m, prompt, do_sample=False, max_length=20, mtp="off", stop_tokens=[])
    stop = plain.tokens[0]
    res = generate(m, prompt, do_sample=False, max_length=20, mtp="off", stop_tokens=[stop])
    assert res.tokens == [stop] and res.stop_reason == "stop_token"
    for mtp in ("off", 3):
        held = generate(m, prompt, do_sample=False, max_length=20, mtp=mtp, stop_tokens=[stop], min_tokens=4)
        assert stop not in held.tokens[:4] and len(held.tokens) >= 4
        assert held.tokens[0] != stop
        if stop in held.tokens:
            assert held.tokens[-1] == stop and held.stop_reason == "stop_token"
    # default stop tokens come from the config (none for a tiny vocabulary)
    assert bind(m).config.stop_tokens == ()


def test_initial_tokens_feed_the_penalties(model, rng):
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    top = generate(m, prompt, do_sample=False, max_length=1, mtp="off").tokens[0]
    # top_k=1 samples the argmax of the penalised logits: deterministic
    kw = dict(do_sample=True, top_k=1, max_length=1, mtp="off", presence_penalty=100.0)
    assert generate(m, prompt, **kw).tokens == [top]
    assert generate(m, prompt, initial_tokens=[top], **kw).tokens != [top]
    assert generate(m, prompt, initial_tokens=[(top + 1) % d["vocab_size"]], **kw).tokens == [top]


def test_bfloat16_execution(model, rng):
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    res = generate(m, prompt, do_sample=False, max_length=12, mtp=2, execution_dtype=torch.bfloat16)
    assert len(res.tokens) == 12 and all(0 <= t < d["vocab_size"] for t in res.tokens)


def test_bind_accepts_the_known_trees(model):
    m, d = model
    b = bind(m)
    assert isinstance(b, Qwen35Binding) and bind(b) is b
    assert bind(m.model).transformer is m.model and bind(m.model).mtp is m.model.mtp
    # ComfyUI's tree: a BaseGenerate-like object whose .model is the decoder, config with ComfyUI's fields
    comfy_cfg = SimpleNamespace(**{k: v for k, v in vars(m.model.config).items()
                                   if k not in ("mtp_num_hidden_layers", "mrope_interleaved")})
    decoder = m.model
    head = decoder.mtp
    decoder.mtp = None
    try:
        decoder.config = comfy_cfg
        wrapper = SimpleNamespace(model=decoder, mtp=head)  # the MTP head on the outer object is found too
        b2 = bind(wrapper)
        assert b2.mtp is head and b2.config.hidden_size == d["hidden_size"]
        assert bind(SimpleNamespace(model=decoder)).mtp is None
    finally:
        decoder.mtp = head
        decoder.config = b.config


def test_bind_rejects_other_trees(model):
    m, _ = model
    with pytest.raises(Qwen35Error, match="not a Qwen3.5 model"):
        bind(torch.nn.Linear(3, 3))
    plain = SimpleNamespace(embed_tokens=1, norm=1, layers=[SimpleNamespace(self_attn=1)])
    with pytest.raises(Qwen35Error, match="Gated DeltaNet"):
        bind(plain)
    layer = m.model.layers[0]
    saved = layer.linear_attn.in_proj_z
    del layer.linear_attn.in_proj_z
    try:
        with pytest.raises(Qwen35Error, match=r"layers\[0\].*in_proj_z"):
            bind(m)
    finally:
        layer.linear_attn.in_proj_z = saved


@pytest.mark.parametrize("where", ["layers", "mtp"])
def test_bind_names_a_merged_gate_up_mlp(model, where):
    """An MLP whose gate and up projections are one module (``gate_up_proj``, as some trees write it) is
    refused when binding, the missing parts named, in a decoder layer and in the MTP head's layer."""
    m, _ = model
    layer = m.model.layers[1] if where == "layers" else bind(m).mtp.layers[0]
    mlp = layer.mlp
    merged = torch.nn.Module()
    merged.gate_up_proj, merged.down_proj = torch.nn.Linear(4, 8), mlp.down_proj
    layer.mlp = merged
    try:
        named = r"lacks \['(layers\.0\.)?mlp\.gate_proj', '(layers\.0\.)?mlp\.up_proj'\]"
        with pytest.raises(Qwen35Error, match=named):
            bind(m)
    finally:
        layer.mlp = mlp
    bind(m)


def test_bad_requests(model):
    m, d = model
    h = d["hidden_size"]
    cases = [
        (dict(embeds=torch.randn(2, 4, h)), "batch size 2"),
        (dict(embeds=torch.randn(4, h + 1)), "hidden size"),
        (dict(embeds=torch.randn(0, h)), "no prompt rows"),
        (dict(embeds=torch.zeros(4, h, dtype=torch.long)), "floating"),
        (dict(max_length=0), "max_length"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(attention="flash"), "attention must be one of"),
        (dict(attention="kitchen"), "cannot run here"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(mtp_draft="beam"), "mtp_draft"),
        (dict(position_ids=torch.arange(5)), "cover 5 rows"),
        (dict(position_ids=torch.zeros(2, 4)), "position_ids"),
    ]
    for kw, msg in cases:
        args = dict(embeds=torch.randn(4, h), max_length=4)
        args.update(kw)
        with pytest.raises(Qwen35Error, match=msg):
            generate(m, args.pop("embeds"), **args)


def test_held_output_weight_same_logits_and_inference_tensors(model, rng):
    """The once-per-generation cast of the output projection gives the per-call logits bit for bit,
    also for weights made under inference mode (as ComfyUI loads them) and for a bf16 table."""
    m, d = model
    b = bind(m)
    h = torch.randn(1, 3, d["hidden_size"], generator=rng)
    want = b.logits(h)
    with b.holding_output_weight():
        assert torch.equal(b.logits(h), want) and torch.equal(b.logits(h), want)
    with torch.inference_mode():  # ComfyUI loads and runs under inference mode
        for name in ("embed_tokens", "lm_head"):
            mod = getattr(b.transformer, name, None)
            if mod is not None:
                mod.weight = torch.nn.Parameter(mod.weight.detach().to(torch.bfloat16), requires_grad=False)
        assert b.transformer.embed_tokens.weight.is_inference()
        want = b.logits(h)
        with b.holding_output_weight():
            assert torch.equal(b.logits(h), want)
        res = generate(m, h[0], do_sample=False, max_length=6, mtp="off")
    assert len(res.tokens) == 6


def test_arguments_out_of_range_are_refused_before_any_work(model):
    """Token ids outside the vocabulary, seeds torch cannot take, a fractional top_k and a max_length
    whose cache cannot fit: Qwen35Error naming the argument, before a single step (no callback)."""
    m, d = model
    vocab = d["vocab_size"]
    cases = [
        (dict(stop_tokens=[vocab]), "stop_tokens.*not a token id"),
        (dict(stop_tokens=[-1]), "stop_tokens.*not a token id"),
        (dict(initial_tokens=[vocab + 5]), "initial_tokens.*not a token id"),
        (dict(initial_tokens=[-3]), "initial_tokens.*not a token id"),
        (dict(seed=2**64), "seed must be an integer from 0 to 2\\*\\*64 - 1"),
        (dict(seed=-1), "seed must be"),
        (dict(top_k=2.7), "top_k must be an integer"),
        (dict(max_length=10**12), "max_length is too large.*GiB"),
    ]
    for kw, msg in cases:
        steps = []
        with pytest.raises(Qwen35Error, match=msg):
            generate(m, torch.randn(4, d["hidden_size"]), max_length=kw.pop("max_length", 4),
                     callback=lambda *a: steps.append(a), **kw)
        assert steps == [], kw
    assert generate(m, torch.randn(4, d["hidden_size"]), max_length=2, top_k=20.0, seed=2**64 - 1).tokens
