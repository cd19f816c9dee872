"""Sampled MTP keeps ComfyUI's target distribution: empirical token frequencies vs exact probabilities.

The exact distribution of the 2nd token and the joint one of the 2nd and 3rd are enumerated with
the float64 reference model and a literal restatement of ComfyUI's sampler. The penalties make
the 3rd token depend on the 2nd, so an accepted draft missing from a later position's history
shows in the joint test. Each chi-square test fails falsely with probability below 1e-7 (six
tests: below 1e-6 in all).
"""

from __future__ import annotations

import pytest
import torch
from qwen35_fast.engine import generate

from tests.oracles.comfy_sampling import comfy_distribution
from tests.oracles.reference import Reference
from tests.oracles.tiny import add_mtp, engine_model, make_tiny

P_FAIL = 1e-7
PARAMS = dict(temperature=0.9, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.3, presence_penalty=1.5)
RUNS = 400


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells expected < 5 are merged)."""
    n = float(counts.sum())
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(1, int(keep.sum()) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def exact_distributions(ref: Reference, prompt: torch.Tensor, vocab: int):
    """Exact distribution of token 2, and joint distribution of tokens (2, 3) flattened to
    ``[V*V]``, under ComfyUI's sampler (float64)."""
    def dist(seq, history):
        return comfy_distribution(ref.forward(seq)["logits"][-1], history, **PARAMS)

    seq0 = prompt.double()
    p1 = dist(seq0, [])
    p2 = torch.zeros(vocab, dtype=torch.float64)
    p23 = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in p1.nonzero().flatten().tolist():
        seq1 = torch.cat([seq0, ref.embed([t1])])
        c2 = dist(seq1, [t1])
        p2 += p1[t1] * c2
        for t2 in c2.nonzero().flatten().tolist():
            p23[t2] += p1[t1] * c2[t2] * dist(torch.cat([seq1, ref.embed([t2])]), [t1, t2])
    return p2, p23.flatten()


def _instance(tmp_path, rng, mtp, draft, tries: int = 8):
    """A random model and prompt. With MTP, one on which a pilot of 20 generations (seeds apart from
    the measured ones) both accepts and rejects drafts: a very peaked random model can leave one
    candidate for draft and target alike, so every draft is accepted and the rejection branch would
    go untested."""
    for attempt in range(tries):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        sd, d = make_tiny(seed, strength=0.2, vocab_size=32)
        # a pull towards repeating the current token, which the penalties must push back against
        sd["lm_head.weight"] = sd["lm_head.weight"] + 0.15 * sd["embed_tokens.weight"]
        sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
        (tmp_path / str(attempt)).mkdir()
        model = engine_model(sd, tmp_path / str(attempt))
        prompt = torch.randn(4, d["hidden_size"], generator=rng)
        if mtp == "off":
            break
        pilot = [generate(model, prompt, do_sample=True, seed=10_000 + run, max_length=4, mtp=mtp, mtp_draft=draft,
                          stop_tokens=[], **PARAMS).stats for run in range(20)]
        if 0 < sum(st.accepted for st in pilot) < sum(st.drafted for st in pilot):
            break
    return model, sd, d, prompt


@pytest.mark.parametrize("mtp,draft,vocab", [("off", "argmax", "full"), (2, "argmax", "full"), (2, "sample", "full"),
                                             ("auto", "argmax", "full"), (2, "sample", "subset")])
def test_sampled_tokens_follow_target_distribution(tmp_path, rng, mtp, draft, vocab, monkeypatch):
    """With ``mtp="auto"`` the depth of token 3 depends on whether token 2's draft was kept: plain
    steps after a rejection, the verify's bonus row after an acceptance (both occur). With
    ``draft_vocab="subset"`` (the first half of the ids) the drafts are drawn from the head's
    distribution over those only, which the acceptance test uses: still the target's distribution."""
    import qwen35_fast.engine.binding as binding
    import qwen35_fast.engine.generation as generation

    from tests.engine.test_mtp_auto import StandIn

    monkeypatch.setattr(binding, "draft_ids", lambda vocab_size: vocab_size // 2)

    # a cycle at depth k costs 1 + 0.7 k plain steps and switching is free: one rejected draft sends
    # the controller to plain steps (estimate 0.25, upper bound 0.63: 1.63 / 1.7 tokens a step) and a
    # kept one keeps it drafting (0.75: 1.75 / 1.7)
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(0.7))
    model, sd, d, prompt = _instance(tmp_path, rng, mtp, draft)
    ref = Reference(sd, d)
    v = d["vocab_size"]
    p2, p23 = exact_distributions(ref, prompt, v)
    c2 = torch.zeros(v, dtype=torch.float64)
    c23 = torch.zeros(v * v, dtype=torch.float64)
    accepted = drafted = switched = 0
    for run in range(RUNS):
        res = generate(model, prompt, do_sample=True, seed=run, max_length=4, mtp=mtp, mtp_draft=draft,
                       stop_tokens=[], draft_vocab=vocab, **PARAMS)
        c2[res.tokens[1]] += 1
        c23[res.tokens[1] * v + res.tokens[2]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
        switched += 0 in res.stats.mtp_depths
    if mtp != "off":
        assert 0 < accepted < drafted, (accepted, drafted)  # both branches of the acceptance rule ran
    if mtp == "auto":
        assert 0 < switched < RUNS, switched
    for counts, probs in ((c2, p2), (c23, p23)):
        assert float(counts[probs == 0].sum()) == 0, "drew a token the target distribution forbids"
        p = chi2_pvalue(counts, probs)
        assert p > P_FAIL, f"chi-square p={p:.3g}: counts {counts.tolist()} vs probs {probs.tolist()}"


def test_mtp_off_sampled_tokens_equal_comfy_loop(tmp_path, rng):
    """MTP off, sampled with both penalties: the engine's tokens (each step launched from the
    previous token on the device, before the host reads it) equal ComfyUI's ``sample_token`` loop
    over a cache-free float64 forward, draw for draw with the same seed."""
    from tests.oracles.comfy_sampling import comfy_sample_token

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2, vocab_size=32)
    model, ref = engine_model(sd, tmp_path), Reference(sd, d)
    prompt = torch.randn(4, d["hidden_size"], generator=rng)
    params = dict(PARAMS, temperature=1.5)
    n = 16

    def comfy_loop(params):
        gen = torch.Generator().manual_seed(11)
        seq, out = prompt.double(), []
        for _ in range(n):
            logits = ref.forward(seq)["logits"][-1].float().unsqueeze(0)
            out.append(int(comfy_sample_token(logits, params["temperature"], params["top_k"], params["top_p"],
                                              params["min_p"], params["repetition_penalty"], out, gen,
                                              presence_penalty=params["presence_penalty"])))
            seq = torch.cat([seq, ref.embed([out[-1]])])
        return out

    want = comfy_loop(params)
    # the penalties decide tokens here: without them the same seed draws otherwise
    assert comfy_loop(dict(params, repetition_penalty=1.0, presence_penalty=0.0)) != want
    res = generate(model, prompt, do_sample=True, seed=11, max_length=n, mtp="off", stop_tokens=[], **params)
    assert res.tokens == want


@pytest.mark.parametrize("reject_at", [None, 1])
def test_sampled_accept_keeps_drafts_and_draws_the_right_row(rng, reject_at):
    """``speculative.accept``, sampled, k = 3 point-mass drafts: drafts of target probability 1 are
    kept; all kept, the bonus token follows the verify's last row; a draft of probability 0 at
    row ``reject_at`` is replaced from that row. The returned device id is the last new token."""
    from qwen35_fast.engine.sampling import Sampler
    from qwen35_fast.engine.sampling_params import SamplingParams
    from qwen35_fast.engine.speculative import accept

    v, k, runs = 6, 3, 3000
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    drafts = torch.tensor([2, 4, 1])
    logits = torch.full((k + 1, v), -1e4)
    logits[torch.arange(k), drafts] = 0.0  # p(draft) = 1 on every draft row
    last = k if reject_at is None else reject_at
    logits[last] = torch.randn(v, generator=rng) * 1.5
    if reject_at is not None:
        logits[last, drafts[last]] = -1e4  # p(draft) = 0: always replaced
    want = torch.softmax(logits[last].double(), dim=-1)  # no penalties or filters: a plain softmax
    counts = torch.zeros(v, dtype=torch.float64)
    for seed in range(runs):
        sampler = Sampler(params, seed=seed, stop_tokens=[], min_tokens=0, initial_tokens=[], device="cpu",
                          mtp_draft="argmax")
        new, accepted, pending = accept(sampler, logits, drafts, [None] * k)
        assert accepted == last and new[:last] == drafts[:last].tolist() and len(new) == last + 1
        assert pending.tolist() == [new[-1]]
        counts[new[-1]] += 1
    assert float(counts[want == 0].sum()) == 0
    p = chi2_pvalue(counts, want)
    assert p > P_FAIL, f"chi-square p={p:.3g}: counts {counts.tolist()} vs probs {want.tolist()}"


@pytest.mark.parametrize("draft", ["argmax", "sample"])
def test_sampled_accept_reads_the_device_once(monkeypatch, rng, draft):
    """A sampled verify step with the enhancer's settings reads from the device once (every
    draft's decision, replacement and the bonus come back together): each read waits for the
    GPU, and the loop runs ahead of it."""
    from qwen35_fast.engine.sampling import Sampler
    from qwen35_fast.engine.sampling_params import SamplingParams
    from qwen35_fast.engine.speculative import accept

    reads = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__", "__index__"):
        def counted(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **kw):
            reads.append(_name)
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5)
    v, k = 512, 3
    seen = set()
    for seed in range(40):
        sampler = Sampler(params, seed=seed, stop_tokens=[1], min_tokens=0, initial_tokens=[3], device="cpu",
                          mtp_draft=draft)
        sampler.accept([5])
        logits = torch.randn(k + 1, v, generator=rng) * 2
        drafts = torch.tensor([7, 8, 9])
        logits[torch.arange(k), drafts] += 7.0  # likely drafts: kept as well as rejected
        qs = [torch.softmax(torch.randn(v, generator=rng), -1) for _ in range(k)] if draft == "sample" else [None] * k
        reads.clear()
        seen.add(accept(sampler, logits, drafts, qs)[1])
        assert reads == ["tolist"], reads
    assert 0 in seen and k in seen, seen  # rejections and a bonus token both came up
