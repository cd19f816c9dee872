"""The draft vocabulary (``engine/draft_vocab.py``): drafts rank the first ids only, the output stays
the target's (greedy: MTP off's tokens), "auto" gives the cut up when the text leaves it.

The tiny random models have a small vocabulary; the tests cut it in half by patching the binding's
``draft_ids`` (the released tokenizer's 151,643 of 248,320 otherwise)."""

from __future__ import annotations

import pytest
import qwen35_fast.engine.binding as binding_module
import qwen35_fast.engine.generation as generation
import torch
from qwen35_fast.engine import bind, generate
from qwen35_fast.engine.draft_vocab import OUTSIDE_MIN, RELEASED_DRAFT_IDS, RELEASED_SPECIALS, DraftVocab, draft_ids
from qwen35_fast.engine.errors import Qwen35Error
from qwen35_fast.engine.plain_weights import PlainLinear, first_rows
from qwen35_fast.kernels import interpreting
from qwen35_fast.kernels.packed4 import Packed4


@pytest.fixture
def half(monkeypatch):
    monkeypatch.setattr(binding_module, "draft_ids", lambda vocab_size: vocab_size // 2)


def _drafts_seen(monkeypatch) -> list[int]:
    """Every draft token the generation makes (``draft`` and ``draft_from``), as a list it fills."""
    seen: list[int] = []
    for name in ("draft", "draft_from"):
        real = getattr(generation, name)

        def spy(*a, _real=real, **kw):
            drafts = _real(*a, **kw)
            seen.extend(drafts.tolist())
            return drafts
        monkeypatch.setattr(generation, name, spy)
    return seen


def test_the_released_vocabulary_has_the_cut_and_others_none():
    assert draft_ids(248_320) == RELEASED_DRAFT_IDS == 151_643
    assert draft_ids(1000) is None and draft_ids(151_936) is None


def test_draft_logits_rank_only_the_first_ids(model, rng, half):
    """Module path: the logits below the cut are the full projection's, the rest -inf."""
    m, d = model
    b = bind(m)
    v, cut = d["vocab_size"], d["vocab_size"] // 2
    assert b.draft_vocab == cut
    h = torch.randn(1, 3, d["hidden_size"], generator=rng)
    full, sub = b.logits(h), b.logits(h, vocab=cut)
    assert sub.shape == full.shape == (1, 3, v) and sub.dtype == torch.float32
    torch.testing.assert_close(sub[..., :cut], full[..., :cut], rtol=0, atol=0)
    assert torch.isneginf(sub[..., cut:]).all()
    torch.testing.assert_close(b.logits(h, vocab=v), full, rtol=0, atol=0)


def test_first_rows_reads_the_same_storage(rng):
    w = torch.randint(-127, 128, (40, 64), dtype=torch.int8, generator=rng)
    per_row = PlainLinear(w, torch.rand(40, generator=rng), convrot=32, bias=torch.randn(40, generator=rng))
    sub = first_rows(per_row, 17)
    assert sub.weight.shape == (17, 64) and sub.weight.data_ptr() == w.data_ptr()
    assert torch.equal(sub.scale, per_row.scale[:17]) and torch.equal(sub.bias, per_row.bias[:17])
    assert sub.convrot == 32
    per_tensor = PlainLinear(w, torch.tensor(0.5))
    assert first_rows(per_tensor, 17).scale is per_tensor.scale
    packed = Packed4.__new__(Packed4)
    assert first_rows(PlainLinear(w, packed=packed), 17) is None


@pytest.mark.skipif(not interpreting(), reason="the fused path on the CPU: set TRITON_INTERPRET=1")
def test_fused_draft_logits_read_the_first_rows(model, rng, half, monkeypatch):
    """The fused path's output weight read in place: a draft's product reads only the first rows
    (the GEMV is handed a weight of ``cut`` rows) and its logits equal the full product's there."""
    from qwen35_fast.engine import plain_weights

    m, d = model
    widths = []
    real = plain_weights.linear_rows

    def spy(x, w, **kw):
        widths.append(w.shape[0])
        return real(x, w, **kw)
    monkeypatch.setattr(binding_module, "linear_rows", spy)
    res = generate(m, torch.randn(1, 5, d["hidden_size"], generator=rng), do_sample=False, max_length=10,
                   stop_tokens=[], mtp=2, fused=True, attention="torch", draft_vocab="subset")
    off = generate(m, torch.randn(1, 5, d["hidden_size"], generator=rng), do_sample=False, max_length=2,
                   stop_tokens=[], mtp="off", fused=True, attention="torch")
    assert off.tokens and d["vocab_size"] // 2 in widths and d["vocab_size"] in widths, sorted(set(widths))
    assert res.stats.draft_vocab == f"drafts over the first {d['vocab_size'] // 2:,} ids"
    # the same product by hand: the first rows' logits, -inf past them
    b, cut = bind(m), d["vocab_size"] // 2
    b.plain_output = PlainLinear(b.output_module.weight.detach())
    h = torch.randn(1, 2, d["hidden_size"], generator=rng)
    widths.clear()
    full, sub = b.logits(h), b.logits(h, vocab=cut)
    assert widths == [d["vocab_size"], cut]
    torch.testing.assert_close(sub[..., :cut], full[..., :cut], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(sub[..., cut:]).all()


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_subset_drafts_stay_below_the_cut_and_tokens_equal_mtp_off(model, rng, half, monkeypatch, fused):
    if fused and not interpreting():
        pytest.skip("the fused path on the CPU: set TRITON_INTERPRET=1")
    m, d = model
    cut = d["vocab_size"] // 2
    prompt = torch.randn(1, 6, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=24, stop_tokens=[], fused=fused, attention="torch")
    off = generate(m, prompt, mtp="off", **kw)
    seen = _drafts_seen(monkeypatch)
    full = generate(m, prompt, mtp=3, draft_vocab="full", **kw)
    assert full.tokens == off.tokens and max(seen) >= cut, "a head drafting above the cut, or this proves nothing"
    seen.clear()
    sub = generate(m, prompt, mtp=3, draft_vocab="subset", **kw)
    assert sub.tokens == off.tokens
    assert seen and max(seen) < cut, sorted(seen)
    assert full.stats.draft_vocab is None


def test_auto_gives_the_cut_up_once_the_text_leaves_it(model, rng, half):
    """The random model's tokens fall on both halves of its vocabulary: "auto" drafts over the
    first half until the text has made ``OUTSIDE_MIN`` tokens above it, then over all ids."""
    m, d = model
    cut = d["vocab_size"] // 2
    prompt = torch.randn(1, 6, d["hidden_size"], generator=rng)
    kw = dict(do_sample=False, max_length=40, stop_tokens=[], attention="torch")
    off = generate(m, prompt, mtp="off", **kw)
    above = [i for i, t in enumerate(off.tokens) if t >= cut]
    assert len(above) >= OUTSIDE_MIN, off.tokens
    res = generate(m, prompt, mtp=3, **kw)
    assert res.tokens == off.tokens
    said = res.stats.draft_vocab
    assert said.startswith(f"drafts over the first {cut:,} ids until token ") and said.endswith(", then all"), said
    at = int(said.split("until token ")[1].split(",")[0])  # after the cycle that made the 4th one above
    assert above[OUTSIDE_MIN - 1] + 1 <= at <= above[OUTSIDE_MIN - 1] + 4, (said, above)


def test_the_gate_counts_text_outside_the_cut_not_special_tokens():
    cut = RELEASED_DRAFT_IDS
    english = DraftVocab("auto", cut)
    english.see([100] * 300 + [cut + 5] * 3 + [RELEASED_SPECIALS, RELEASED_SPECIALS + 2] * 10)
    assert english.rows == cut and english.switched_at is None  # 3 outside, and specials do not count
    rare = DraftVocab("auto", cut)
    rare.see([100] * 300)
    rare.see([cut + 1] * 5)  # 5 of 305: under 2%
    assert rare.rows == cut
    foreign = DraftVocab("auto", cut)
    for t in [100, 200, cut + 9, 300, cut + 1, cut + 2, 5, cut + 70_000]:
        foreign.see([t])
    assert foreign.rows is None and foreign.switched_at == 8
    assert "until token 8, then all" in foreign.describe()
    fixed = DraftVocab("subset", cut)
    fixed.see([cut + 1] * 50)
    assert fixed.rows == cut and DraftVocab("full", cut).rows is None and DraftVocab("auto", None).rows is None


def test_a_bad_draft_vocab_is_refused(model):
    m, d = model
    with pytest.raises(Qwen35Error, match="draft_vocab must be one of 'auto', 'subset', 'full'"):
        generate(m, torch.zeros(1, 2, d["hidden_size"]), max_length=2, mtp=2, draft_vocab="some")
