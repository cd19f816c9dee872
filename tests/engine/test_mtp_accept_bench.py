"""``benchmarks/mtp_accept.py`` (``comfy_e2e.py --accept``) on a tiny model on the CPU: every row
gets the acceptance its P asks for, the clock's window is timed, and the table names auto's ratios."""

from __future__ import annotations

import types

import torch

from benchmarks.comfy_e2e import TokenClock, markdown
from benchmarks.mtp_accept import KINDS, sweep, table
from tests.oracles.tiny import add_mtp, engine_model, make_tiny


class _Bar:
    def __init__(self, total):
        self.total = total

    def update_absolute(self, value, total=None, preview=None):
        pass


def test_accept_sweep_rows_and_table(tmp_path, rng, monkeypatch):
    import qwen35_fast.engine.generation as generation

    from tests.engine.test_mtp_auto import StandIn

    # the CPU's own costs (a 2-row verify of this tiny model costs several 1-row steps) may rightly
    # keep auto plain at P = 1: stand-in costs of a GPU-like ratio make its depths predictable
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(0.2))
    sd, d = make_tiny(11, strength=0.2)
    model = engine_model(add_mtp(sd, d, 12, noise=0.02, norm_spread=0.05), tmp_path)
    target = types.SimpleNamespace(transformer=model)
    clock = TokenClock(types.SimpleNamespace(ProgressBar=_Bar))
    prompt = torch.randn(1, 5, d["hidden_size"], generator=rng)
    greedy = dict(do_sample=False)
    rows = sweep("tiny", target, prompt, clock, ps=[0.0, 1.0], tokens=24, modes={"greedy": greedy},
                 vocab=d["vocab_size"])
    warmup, *rows = rows
    # the untimed auto generation left drafting and probed, so no timed row captures the probes' graphs
    assert warmup["kind"] == "accept-warmup" and warmup["probes"] >= 1 and "0" in warmup["depths"], warmup
    assert [(r["p"], r["mtp"]) for r in rows] == [(p, k) for p in (0.0, 1.0) for k in KINDS]
    for r in rows:
        assert r["tok_s"] > 0
        # each row ran on the stack the row before it left, as one ComfyUI run does after another
        assert r["decode_path"].endswith("(kept from the last generation)"), r["decode_path"]
        if r["mtp"] in ("1", "2", "3", "4", "5"):
            assert r["acceptance"] == r["p"], r  # greedy: a right draft is always kept, a wrong one never
    auto = {r["p"]: r for r in rows if r["mtp"] == "auto"}
    assert "0" in auto[0.0]["depths"] and "5" in auto[1.0]["depths"], auto
    md = table(rows)
    assert md.count("\n| tiny | greedy |") == 2 and "auto / best" in md
    # comfy_e2e's report of the saved run (the warm-up row included) holds the same table
    run = dict(device="cpu", torch=torch.__version__, comfyui="-", copy_bw_Bps=1e12, prompt=5, rows=[warmup, *rows])
    assert md in markdown(run)


def test_token_clock_reports_tokens_an_update(monkeypatch):
    """``TokenClock.run`` on a clock whose times are set here: an MTP-3 generation reporting 4 tokens an
    update from token 9 on gives tok/s over the timed updates, ``tokens_per_update`` 4.0 and the
    updates' spacing (median, 90th percentile, largest, ms) with one slow update seen as the largest."""
    import benchmarks.comfy_e2e as e2e

    now = iter([0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.09])
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: next(now))
    clock = TokenClock(types.SimpleNamespace(ProgressBar=_Bar))

    def generate():
        for value in (1, 5, 9, 13, 17, 21, 25, 29):
            clock.tick(value)

    tok_s = clock.run(generate, 25)
    assert abs(tok_s - 16 / 0.06) < 1e-6
    assert clock.last["tokens_per_update"] == 4.0
    assert clock.last["update_ms"] == [10.0, 10.0, 30.0]
