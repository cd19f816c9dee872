"""Sampled decoding: ComfyUI's target distribution at every MTP setting, and one text per seed.

The exact distribution of the 2nd token and the joint one of the 2nd and 3rd are enumerated with
the float64 reference model and a literal restatement of ComfyUI's sampler; the engine's tokens
over many seeds must follow them, MTP off and at every depth. The penalties make the 3rd token
depend on the 2nd, so an accepted draft missing from a later position's history shows in the
joint test. Each chi-square test fails falsely with probability below 1e-7 (sixteen tests: below
2e-6 in all). For one seed the tokens are the keyed-draw oracle's (``tests/oracles/keyed_draw.py``)
over the float64 reference, and the same at every ``mtp`` setting, ``"auto"`` included.
"""

from __future__ import annotations

import pytest
import torch
from qwen35_fast.engine import generate

from tests.engine.test_mtp_auto import StandIn
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


@pytest.mark.parametrize("mtp,draft,vocab", [("off", "argmax", "full"), (1, "argmax", "full"), (2, "argmax", "full"),
                                             (3, "sample", "full"), (4, "argmax", "full"), (5, "sample", "full"),
                                             ("auto", "argmax", "full"), (2, "sample", "subset")])
def test_sampled_tokens_follow_target_distribution(tmp_path, rng, mtp, draft, vocab, monkeypatch):
    """With ``mtp="auto"`` the depth of token 3 depends on whether token 2's draft was kept: plain
    steps after a rejection, the verify's bonus row after an acceptance (both occur). With
    ``draft_vocab="subset"`` (the first half of the ids) the drafts are drawn from the head's
    distribution over those only: still the target's distribution."""
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


def test_sampled_tokens_equal_the_keyed_oracle_loop(tmp_path, rng):
    """MTP off, sampled with both penalties: the engine's tokens (each step launched from the
    previous token on the device, before the host reads it) equal the keyed-draw oracle's loop over
    a cache-free float64 forward and ComfyUI's distribution, the token after ``i`` generated ones at
    position ``prompt + i``; with MTP at depth 3 as well."""
    from tests.oracles import keyed_draw as oracle

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2, vocab_size=32)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model, ref = engine_model(sd, tmp_path), Reference(sd, d)
    prompt = torch.randn(4, d["hidden_size"], generator=rng)
    params = dict(PARAMS, temperature=1.5)
    n, draw_seed = 16, 2**63 + 11

    def oracle_loop(params):
        seq, out, gaps = prompt.double(), [], []
        for i in range(n):
            probs = comfy_distribution(ref.forward(seq)["logits"][-1], out, **params)
            token, gap = oracle.draw(probs, draw_seed, prompt.shape[0] + i)
            out.append(token)
            gaps.append(gap)
            seq = torch.cat([seq, ref.embed([token])])
        return out, min(gaps)

    want, gap = oracle_loop(params)
    assert gap > 1e-4, "a draw the float32 engine could decide otherwise: pick another case"
    # the penalties decide tokens here: without them the same seed draws otherwise
    assert oracle_loop(dict(params, repetition_penalty=1.0, presence_penalty=0.0))[0] != want
    for mtp in ("off", 3):
        res = generate(model, prompt, do_sample=True, seed=draw_seed, max_length=n, mtp=mtp, stop_tokens=[], **params)
        assert res.tokens == want, mtp


class Switching(StandIn):
    """Cycle costs for ``mtp="auto"`` (the controller's cost interface) that change every ``period``
    estimates between cheap drafting (a cycle at depth k: ``1 + 0.05 k`` plain steps) and dear
    drafting (``1 + 3 k``), so the controller runs deep cycles, plain segments with probes, and back."""

    def __init__(self, period: int):
        super().__init__(0.0)
        self.period, self.calls = period, 0

    def estimate(self, depth: int) -> float:
        self.calls += 1
        return 1.0 + (0.05 if (self.calls // self.period) % 2 == 0 else 3.0) * depth


@pytest.mark.parametrize("draft", ["argmax", "sample"])
def test_sampled_text_is_the_same_at_every_mtp_setting(model, rng, monkeypatch, draft):
    """One seed, the enhancer's text-to-image settings: MTP off, depths 1, 2, 3, 5 and ``"auto"`` (its
    costs switching between cheap and dear drafting every few estimates, so it runs at three depths
    or more) give the same tokens; drafts were kept and rejected."""
    import qwen35_fast.engine.generation as generation

    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: Switching(5))
    m, d = model
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5, seed=12345,
              max_length=60, stop_tokens=[], mtp_draft=draft)
    off = generate(m, prompt, mtp="off", **kw)
    assert len(set(off.tokens)) > 10
    accepted = drafted = 0
    for mtp in (1, 2, 3, 5, "auto"):
        res = generate(m, prompt, mtp=mtp, **kw)
        assert res.tokens == off.tokens, mtp
        accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
    assert 0 < accepted < drafted, (accepted, drafted)
    assert len([k for k in res.stats.mtp_depths if k]) >= 3, res.stats.mtp_depths


def test_twelve_auto_runs_with_one_seed_give_one_text(model, rng, monkeypatch):
    """Sampled ``mtp="auto"``, one seed, 12 runs whose depth choices differ (each run's costs switch
    at another period, as wall-clock costs differ from run to run; some runs go deep, some leave
    drafting for plain segments): one text, MTP off's."""
    import qwen35_fast.engine.generation as generation

    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5, seed=7,
              max_length=64, stop_tokens=[])
    off = generate(m, prompt, mtp="off", **kw)
    texts, paths = set(), set()
    for run in range(12):
        monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth, run=run: Switching(3 + 4 * run))
        res = generate(m, prompt, mtp="auto", **kw)
        texts.add(tuple(res.tokens))
        paths.add(tuple(sorted(res.stats.mtp_depths.items())))
    assert texts == {tuple(off.tokens)}
    # the runs really took different depths: several paths, plain segments in some, depth 3+ in others
    assert len(paths) >= 4 and any(dict(p).get(0) for p in paths) and any(max(dict(p)) >= 3 for p in paths), paths


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_keeps_drafts_equal_to_the_models_tokens(rng, greedy):
    """``speculative.accept``, k = 3 drafts: the new tokens and the count kept are the verify rule's
    (``tests/oracles/speculative_rule.py``) over the model's token at each row: greedy, the argmax;
    sampled, the keyed-draw oracle's at position ``first_position + generated + row`` with the
    drafts before the row in its penalties' history. Kept, rejected and all-accepted drafts occur."""
    from qwen35_fast.engine.sampling import Sampler
    from qwen35_fast.engine.sampling_params import SamplingParams
    from qwen35_fast.engine.speculative import accept

    from tests.oracles import keyed_draw as oracle
    from tests.oracles.speculative_rule import verify_outcome

    settings = dict(temperature=1.0, top_k=5, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.7)
    params = SamplingParams(do_sample=not greedy, **settings)
    v, k, first = 40, 3, 9
    seen_counts = set()
    for seed in range(60):
        sampler = Sampler(params, seed=seed, first_position=first, stop_tokens=[], min_tokens=0, initial_tokens=[3],
                          device="cpu", mtp_draft="argmax")
        sampler.accept([5, 6])
        logits = torch.randn(k + 1, v, generator=rng)
        drafts = torch.randint(0, v, (k,), generator=rng)
        likely = torch.rand(k, generator=rng) < 0.8
        logits[torch.arange(k)[likely], drafts[likely]] += 5.0
        targets = []
        for i in range(k + 1):
            history = [3, 5, 6] + drafts[:i].tolist()
            if greedy:
                targets.append(int(logits[i].argmax()))
            else:
                probs = comfy_distribution(logits[i], history, **settings)
                targets.append(oracle.draw(probs, seed, first + 2 + i)[0])
        want, kept = verify_outcome(targets, drafts.tolist())
        new, accepted, pending = accept(sampler, logits, drafts)
        assert (new, accepted) == (want, kept), seed
        assert pending.tolist() == [new[-1]]
        seen_counts.add(accepted)
    assert {0, k} <= seen_counts and len(seen_counts) >= 3, seen_counts


def test_sampled_accept_reads_the_device_once(monkeypatch, rng):
    """A sampled verify step with the enhancer's settings reads from the device once (every
    row's token and the drafts come back together): each read waits for the GPU, and the loop runs
    ahead of it."""
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
        sampler = Sampler(params, seed=seed, first_position=4, stop_tokens=[1], min_tokens=0, initial_tokens=[3],
                          device="cpu", mtp_draft="argmax")
        sampler.accept([5])
        logits = torch.randn(k + 1, v, generator=rng) * 2
        drafts = torch.tensor([7, 8, 9])
        logits[torch.arange(k), drafts] += 7.0  # likely drafts: kept as well as rejected
        reads.clear()
        seen.add(accept(sampler, logits, drafts)[1])
        assert reads == ["tolist"], reads
    assert 0 in seen and k in seen, seen  # rejections and a bonus token both came up
