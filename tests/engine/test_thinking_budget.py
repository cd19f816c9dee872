"""A thinking budget (``engine/thinking.py``): the block closed at the budget, the answer after it.

The oracle is a cache-free float64 loop over the reference model (``tests/oracles/reference.py``):
each token is the greedy pick or the keyed draw from ComfyUI's distribution at its position, except
the ``close`` ids placed right after the budget when the model has not ended its thinking by then.
The engine must give the oracle's tokens MTP off, at fixed depths and under ``mtp="auto"`` switching
depths (the budget's pause lands inside cycles and segments at every setting).
"""

from __future__ import annotations

import pytest
import torch
from qwen35_fast.engine import Qwen35Error, ThinkingBudget, generate

from tests.engine.test_engine_sampled import Switching
from tests.oracles import keyed_draw
from tests.oracles.comfy_sampling import comfy_distribution
from tests.oracles.reference import Reference
from tests.oracles.tiny import add_mtp, engine_model, make_tiny

PARAMS = dict(temperature=1.2, top_k=8, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=1.5)
SEED = 2**40 + 3


def oracle(ref: Reference, prompt: torch.Tensor, n: int, *, sampled: bool, budget: int = 0, close=(), end=-1):
    """The reference's ``n`` tokens with the budget's rule, and the smallest decision margin (the
    relative gap between the winner and the runner-up)."""
    seq, out, gaps, forced = prompt.double(), [], [], {}
    for i in range(n):
        if budget and i == budget and end not in out:
            forced = {budget + j: t for j, t in enumerate(close)}
        if i in forced:
            token = forced[i]
        else:
            logits = ref.forward(seq)["logits"][-1]
            if sampled:
                token, gap = keyed_draw.draw(comfy_distribution(logits, out, **PARAMS), SEED, prompt.shape[0] + i)
            else:
                top = logits.topk(2).values
                token, gap = int(logits.argmax()), float((top[0] - top[1]) / top[0].abs().clamp_min(1e-9))
            gaps.append(gap)
        out.append(token)
        seq = torch.cat([seq, ref.embed([token])])
    return out, min(gaps)


@pytest.fixture
def case(tmp_path, rng):
    """A tiny model with an MTP head whose drafts are sometimes kept, its float64 reference, a prompt."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2, vocab_size=48)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    return engine_model(sd, tmp_path), Reference(sd, d), prompt, d


@pytest.mark.parametrize("sampled", [False, True])
def test_the_budget_closes_thinking_and_the_answer_follows(case, monkeypatch, sampled):
    """Budget 9 of 24 tokens, close = three ids with the end id second, an end id the model does not
    write first: the tokens are the oracle's at MTP off, depths 1, 3 and 5 and auto; the stats count
    9 + 1 thinking tokens (the close's first id is still inside the block) and say the budget cut them."""
    import qwen35_fast.engine.generation as generation

    model, ref, prompt, d = case
    n, budget = 24, 9
    free, _ = oracle(ref, prompt, n, sampled=sampled)
    end = next(t for t in range(d["vocab_size"]) if t not in free)  # the model never ends its thinking here
    close = (free[budget - 1] ^ 1, end, (end + 5) % d["vocab_size"])
    want, gap = oracle(ref, prompt, n, sampled=sampled, budget=budget, close=close, end=end)
    assert gap > 1e-4, "a decision the float32 engine could take otherwise: pick another case"
    assert want[:budget] == free[:budget] and want[budget:budget + 3] == list(close) and want != free
    budget_of = ThinkingBudget(budget, close, end)
    kw = dict(do_sample=sampled, seed=SEED, max_length=n, stop_tokens=[], thinking_budget=budget_of, **PARAMS)
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: Switching(2))
    for mtp in ("off", 1, 3, 5, "auto"):
        res = generate(model, prompt, mtp=mtp, **kw)
        assert res.tokens == want, mtp
        assert (res.stats.thinking_tokens, res.stats.thinking_cut) == (budget + 1, True), mtp


def test_a_model_that_ends_its_thinking_is_not_cut(case):
    """The end id is the model's own 4th token: budgets 10 and 4 change nothing (the 4th token is the
    last one the budget of 4 lets it think), thinking_tokens 3; budget 3 cuts it; budget 0 is none."""
    model, ref, prompt, d = case
    n = 16
    free, gap = oracle(ref, prompt, n, sampled=False)
    assert gap > 1e-4, "a decision the float32 engine could take otherwise: pick another case"
    end = free[3]
    if end in free[:3]:
        pytest.skip("the 4th token repeats an earlier one in this case")
    close = ((end + 1) % d["vocab_size"], end)
    kw = dict(do_sample=False, max_length=n, stop_tokens=[], mtp=2)
    for budget in (10, 4):
        res = generate(model, prompt, thinking_budget=ThinkingBudget(budget, close, end), **kw)
        assert res.tokens == free and (res.stats.thinking_tokens, res.stats.thinking_cut) == (3, False), budget
    cut = generate(model, prompt, thinking_budget=ThinkingBudget(3, close, end), **kw)
    assert cut.tokens[:5] == [*free[:3], *close] and cut.stats.thinking_cut
    none = generate(model, prompt, thinking_budget=None, **kw)
    assert none.tokens == free and none.stats.thinking_tokens is None and not none.stats.thinking_cut


@pytest.mark.parametrize("value,words", [
    (ThinkingBudget(-1, (1,), 1), "integer >= 0"),
    (ThinkingBudget(5, (), 1), "close"),
    (ThinkingBudget(5, (2, 3), 1), "end"),
    (ThinkingBudget(5, (2, 999), 999), "0.."),
    (7, r"ThinkingBudget\(tokens, close, end\)"),
])
def test_a_bad_budget_is_refused_before_any_step(case, value, words):
    model, _, prompt, _ = case
    with pytest.raises(Qwen35Error, match=words):
        generate(model, prompt, max_length=4, thinking_budget=value)
