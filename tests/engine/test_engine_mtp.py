"""MTP speculative decoding: exact greedy equality, drafts vs the reference head, state after a rejection."""

from __future__ import annotations

import logging

import pytest
import qwen35_fast.engine.generation as generation
import qwen35_fast.engine.speculative as speculative
import qwen35_fast.engine.stack as stack
import torch
from qwen35_fast.engine import Qwen35Error, bind, generate
from qwen35_fast.engine.cache import DeltaNetState, KVCache
from qwen35_fast.engine.forward import Runner

from tests.oracles.reference import Reference
from tests.oracles.tiny import add_mtp, engine_model, make_tiny


def _seed(rng) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


@pytest.fixture
def mtp_model(tmp_path, rng):
    """A tiny model (vocab 96) whose MTP head drafts tokens that are often but not always right."""
    sd, d = make_tiny(_seed(rng), strength=0.2)
    sd = add_mtp(sd, d, _seed(rng), noise=0.02, norm_spread=0.05)
    return engine_model(sd, tmp_path), sd, d


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_greedy_mtp_equals_plain_greedy(mtp_model, rng, depth):
    model, _, d = mtp_model
    accepted = drafted = 0
    for _ in range(3):
        prompt = torch.randn(int(torch.randint(3, 12, (1,), generator=rng)), d["hidden_size"], generator=rng)
        plain = generate(model, prompt, do_sample=False, max_length=40, mtp="off", stop_tokens=[])
        spec = generate(model, prompt, do_sample=False, max_length=40, mtp=depth, stop_tokens=[])
        assert spec.tokens == plain.tokens
        assert spec.stats.mtp_depth == depth and spec.stats.steps < plain.stats.steps
        accepted += spec.stats.accepted
        drafted += spec.stats.drafted
    # drafts really were accepted, and rejected: both paths of the verify ran
    assert 0 < accepted < drafted


def test_int8_head_reads_in_place_and_stays_exact(mtp_model, rng):
    """The MTP head held as int8 rows (``engine.int8_head``, as the pack keeps it beside a 4-bit model):
    every projection within half a step of its row scale of the float weight, read in place by the
    fused path as int8 rows, drafts still kept, and greedy tokens equal MTP off, fused and not."""
    from qwen35_fast.engine import int8_head
    from qwen35_fast.engine.fused import FusedPlan
    from qwen35_fast.engine.modules import Int8Linear

    model, _, d = mtp_model
    head = bind(model).mtp
    floats = {n: m.weight.detach().double() for n, m in head.named_modules() if isinstance(m, torch.nn.Linear)}
    prompt = torch.randn(7, d["hidden_size"], generator=rng)
    plain = generate(model, prompt, do_sample=False, max_length=24, mtp="off", stop_tokens=[], fused=False)
    assert int8_head(head) == sum(3 * w.numel() - 4 * w.shape[0] for w in floats.values())  # float32 -> int8 + scales
    assert len(floats) == 8  # fc, q/k/v/o, gate/up/down
    for name, w in floats.items():
        q = head.get_submodule(name)
        assert isinstance(q, Int8Linear) and q.weight.dtype == torch.int8
        step = q.row_scale.double()[:, None]
        assert ((q.weight.double() * step - w).abs() <= step / 2 + 1e-9).all(), name
    plan, why = FusedPlan.build(bind(model), "cpu", torch.float32)
    assert why is None
    for name in floats:
        rec = plan.linears[id(head.get_submodule(name))]
        assert rec.weight.dtype == torch.int8 and rec.weight.data_ptr() == head.get_submodule(name).weight.data_ptr()
    for fused in (False, True):
        spec = generate(model, prompt, do_sample=False, max_length=24, mtp=3, stop_tokens=[], fused=fused)
        assert spec.tokens == plain.tokens and spec.stats.accepted > 0, fused


def test_greedy_mtp_with_stop_token_and_prenorm(mtp_model, rng):
    model, _, d = mtp_model
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    plain = generate(model, prompt, do_sample=False, max_length=30, mtp="off", stop_tokens=[])
    stop = plain.tokens[12]
    first = plain.tokens.index(stop)
    want = generate(model, prompt, do_sample=False, max_length=30, mtp="off", stop_tokens=[stop])
    assert want.tokens == plain.tokens[:first + 1] and want.stop_reason == "stop_token"
    for depth in (2, 5):
        got = generate(model, prompt, do_sample=False, max_length=30, mtp=depth, stop_tokens=[stop])
        assert got.tokens == want.tokens and got.stop_reason == "stop_token"
    b = bind(model)
    b.mtp_hidden = "prenorm"  # the other hidden-state convention still decodes exactly
    got = generate(b, prompt, do_sample=False, max_length=30, mtp=3, stop_tokens=[])
    assert got.tokens == plain.tokens


def test_drafts_follow_reference_head(mtp_model, rng, monkeypatch):
    """Every draft equals the argmax of the reference MTP head fed with the true hidden state of the
    newest row, then with its own outputs for deeper drafts."""
    model, sd, d = mtp_model
    ref = Reference(sd, d)
    seen = []
    real = speculative.draft_from

    def spy(binding, runner, sampler, positions, last, logits, length, k, vocab=None):
        drafts = real(binding, runner, sampler, positions, last, logits, length, k, vocab=vocab)
        seen.append((list(sampler.generated), length, drafts))
        return drafts

    # every step's drafts: the first after the prompt's catch-up (draft), the rest after a verify's
    monkeypatch.setattr(speculative, "draft_from", spy)
    monkeypatch.setattr(generation, "draft_from", spy)
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    res = generate(model, prompt, do_sample=False, max_length=16, mtp=3, stop_tokens=[])
    assert len(seen) >= 3
    for generated, length, drafts in seen:
        seq = torch.cat([prompt.double(), ref.embed(generated)], dim=0)  # rows 0..length (pending last)
        assert seq.shape[0] == length + 1
        hidden = ref.forward(seq[:length])["hidden"]
        hid, nxt = hidden, seq[1:length + 1]
        for j, want in enumerate(drafts):
            out, logits = ref.mtp(hid, nxt)
            top2 = logits[-1].topk(2).values
            if float(top2[0] - top2[1]) > 1e-4:  # skip float32/float64 near-ties
                assert int(logits[-1].argmax()) == want, (generated, j)
            hid = torch.cat([hid, out[-1:]], dim=0)
            nxt = torch.cat([nxt, ref.embed([drafts[j]])], dim=0)
    assert res.stats.drafted == sum(len(x[2]) for x in seen)


class _Stop(Exception):
    pass


def test_state_after_rejection_equals_fresh_run(mtp_model, rng, monkeypatch):
    """After a partly accepted verify, every DeltaNet state, K/V slot and length equals that of a fresh
    run fed only the kept tokens."""
    model, _, d = mtp_model
    made = []
    real_cache = stack.ModelCache

    def keep_cache(*args, **kwargs):
        made.append(real_cache(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(stack, "ModelCache", keep_cache)
    checked = 0
    for _ in range(4):
        prompt = torch.randn(7, d["hidden_size"], generator=rng)
        snap = {}

        def on_step(all_tokens, new, stats, snap=snap):
            # a step that kept fewer than all of its drafts: the verify rolled back
            if stats.steps and len(new) < 4:
                c = made[-1]
                snap["tokens"] = list(all_tokens)
                snap["new"] = len(new)
                snap["layers"] = [(x.recurrent.clone(), x.conv.clone()) if isinstance(x, DeltaNetState)
                                  else (x.k[:, :, :x.host_length].clone(), x.v[:, :, :x.host_length].clone(),
                                        int(x.length[0]), x.host_length) for x in c.layers]
                snap["mtp_length"] = (int(c.mtp.length[0]), c.mtp.host_length)
                raise _Stop

        with pytest.raises(_Stop):
            generate(model, prompt, do_sample=False, max_length=60, mtp=3, stop_tokens=[], callback=on_step)
        if "tokens" not in snap:
            continue
        kept = snap["tokens"][:-1]  # the newest token is pending: not yet fed through the model
        b = bind(model)
        fresh = real_cache(b.config, batch=1, capacity=128, dtype=torch.float32, device="cpu")
        run = Runner(b, fresh, dtype=torch.float32, device="cpu")
        run.forward(prompt[None], torch.arange(7).expand(3, -1), keep_rows=False)
        fresh.commit()
        for i, tok in enumerate(kept):
            emb = b.embed(torch.tensor([[tok]]), torch.float32, "cpu")
            run.forward(emb, torch.tensor([7 + i]).expand(3, 1))
            fresh.commit()
        length = 7 + len(kept)
        for got, want in zip(snap["layers"], fresh.layers):
            if isinstance(want, DeltaNetState):
                torch.testing.assert_close(got[0], want.recurrent, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got[1], want.conv, atol=1e-5, rtol=1e-5)
            else:
                assert isinstance(want, KVCache)
                assert got[2] == got[3] == length == want.host_length
                torch.testing.assert_close(got[0], want.k[:, :, :length], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got[1], want.v[:, :, :length], atol=1e-5, rtol=1e-5)
        # the next step's drafts ran before this callback: the MTP cache took this step's true hidden
        # states as its catch-up rows and rolled its draft rows back, so it ends at the main length
        # (mid-generation; a step that launches no drafts leaves it at length - new)
        assert snap["mtp_length"] == (length,) * 2
        checked += 1
    assert checked >= 2


def test_mtp_modes_without_head(tmp_path, rng, caplog):
    sd, d = make_tiny(_seed(rng))
    model = engine_model(sd, tmp_path)
    prompt = torch.randn(4, d["hidden_size"], generator=rng)
    with caplog.at_level(logging.INFO, logger="qwen35_fast.engine.request"):
        res = generate(model, prompt, do_sample=False, max_length=5, mtp="auto")
    assert res.stats.mtp_depth == 0 and "no MTP head" in caplog.text
    with pytest.raises(Qwen35Error, match="needs an MTP head"):
        generate(model, prompt, do_sample=False, max_length=5, mtp=2)
    for bad in (0.5, 6, "deep", True):
        with pytest.raises(Qwen35Error, match="mtp must be"):
            generate(model, prompt, max_length=5, mtp=bad)


def test_cache_sized_for_mtp(mtp_model, rng):
    """max_length reached exactly, whatever the depth: the tail steps draft fewer tokens."""
    model, _, d = mtp_model
    prompt = torch.randn(3, d["hidden_size"], generator=rng)
    for n in (1, 2, 7):
        for depth in (1, 5):
            res = generate(model, prompt, do_sample=True, seed=n, max_length=n, mtp=depth, stop_tokens=[])
            assert len(res.tokens) == n and res.stop_reason == "max_length"


def test_catch_up_runs_before_the_host_reads_the_verify(mtp_model, rng, monkeypatch):
    """After every verify step the MTP head's catch-up is launched before the host waits for what
    the verify kept (so the GPU goes on from the verify to the head), and its drafts still equal
    plain greedy's tokens."""
    import qwen35_fast.engine.readback as readback

    model, _, d = mtp_model
    events = []
    real_head, real_values = Runner.mtp_logits, readback.Readback.values

    def head(self, hidden, emb, pos, row=None, vocab=None):
        events.append(("head", hidden.shape[1], row is not None))
        return real_head(self, hidden, emb, pos, row=row, vocab=vocab)

    def values(self):
        events.append(("read", self.n))
        return real_values(self)

    monkeypatch.setattr(Runner, "mtp_logits", head)
    monkeypatch.setattr(readback.Readback, "values", values)
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    plain = generate(model, prompt, do_sample=False, max_length=30, mtp="off", stop_tokens=[])
    events.clear()
    depth = 3
    spec = generate(model, prompt, do_sample=False, max_length=30, mtp=depth, stop_tokens=[])
    assert spec.tokens == plain.tokens
    reads = [i for i, e in enumerate(events) if e[0] == "read" and e[1] == 2 * depth + 1]  # the verify's read
    assert len(reads) >= 3
    for i in reads[:-2]:  # the last steps near max_length draft fewer rows or none
        assert events[i - 1] == ("head", depth + 1, True), events[max(0, i - 3):i + 1]


@pytest.mark.parametrize("greedy", [True, False])
def test_verdict_on_the_device_matches_the_read(rng, greedy):
    """``judge``'s device outcome (accepted count, the new tokens, row by row) equals what ``settle``
    reads and decides on the host, for kept, rejected and all-accepted drafts."""
    from qwen35_fast.engine.sampling import Sampler
    from qwen35_fast.engine.sampling_params import SamplingParams
    from qwen35_fast.engine.speculative import judge, settle

    params = SamplingParams(do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    v, k = 7, 3
    seen = set()
    for seed in range(60):
        sampler = Sampler(params, seed=seed, first_position=5, stop_tokens=[], min_tokens=0, initial_tokens=[],
                          device="cpu", mtp_draft="argmax")
        drafts = torch.randint(0, v, (k,), generator=rng)
        logits = torch.randn(k + 1, v, generator=rng)
        likely = torch.rand(k, generator=rng) < 0.7
        logits[torch.arange(k)[likely], drafts[likely]] += 6.0  # most drafts kept, some rejected
        verdict = judge(sampler, logits, drafts)
        new, accepted, pending = settle(verdict)
        assert int(verdict.accepted) == accepted and len(new) == accepted + 1
        assert verdict.new_ids[:accepted + 1].tolist() == new and pending.tolist() == [new[-1]]
        seen.add(accepted)
    assert {0, k} <= seen and len(seen) >= 3, seen
