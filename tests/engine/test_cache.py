"""Length-aware cache: K/V staging, commit, rollback, overflow; DeltaNet per-row states vs replay."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from qwen35_fast.engine import Qwen35Error
from qwen35_fast.engine.cache import DeltaNetState, KVCache, ModelCache
from qwen35_fast.engine.deltanet import gates, prepare_qkv, recurrent_rows

from tests.oracles.tiny import make_tiny


def _rows(rng, s, hkv=2, d=8):
    return torch.randn(1, hkv, s, d, generator=rng), torch.randn(1, hkv, s, d, generator=rng)


def test_kv_write_commit_rollback(rng):
    kv = KVCache(1, 2, 10, 8, dtype=torch.float32, device="cpu", fill=float("nan"))
    k1, v1 = _rows(rng, 3)
    lengths = kv.write(k1, v1)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [3] and kv.host_length == 0
    kv.commit()
    k2, v2 = _rows(rng, 4)
    assert kv.write(k2, v2).tolist() == [7]
    kv.commit(2)  # keep 2 of 4 staged rows
    assert kv.host_length == 5 and kv.length.tolist() == [5]
    k3, v3 = _rows(rng, 1)
    kv.write(k3, v3)
    kv.commit()
    k, v = kv.filled()
    torch.testing.assert_close(k, torch.cat([k1, k2[:, :, :2], k3], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([v1, v2[:, :, :2], v3], dim=2), rtol=0, atol=0)
    assert torch.isnan(kv.k[:, :, 7:]).all()  # never touched past the rows ever written
    kv.rollback(2)
    assert kv.host_length == 4 and kv.length.tolist() == [4]
    with pytest.raises(Qwen35Error, match="cannot drop 5"):
        kv.rollback(5)


def test_kv_rows_counted_later(rng):
    """``write_rows(count_later=True)``: the rows are staged but ``length`` stays at the committed
    count until ``count()`` (or a kernel, then ``counted()``); committing before is refused."""
    kv = KVCache(1, 2, 10, 8, dtype=torch.float32, device="cpu")
    k1, v1 = _rows(rng, 3)

    def write(kc, vc, length):
        kc[:, :, :3], vc[:, :, :3] = k1, v1

    assert kv.write_rows(3, write, count_later=True).tolist() == [0] and kv.staged == 3
    with pytest.raises(Qwen35Error, match="never counted"):
        kv.commit()
    assert kv.count().tolist() == [3] and kv.count().tolist() == [3]  # counted once
    kv.commit(2)
    assert kv.host_length == 2 and kv.length.tolist() == [2]
    kv.write_rows(1, lambda kc, vc, length: None, count_later=True)
    kv.length.add_(1)  # what the attention's merge does on the device
    kv.counted()
    kv.commit()
    assert kv.host_length == 3 and kv.length.tolist() == [3]


def test_kv_errors(rng):
    kv = KVCache(1, 2, 5, 8, dtype=torch.float32, device="cpu")
    k, v = _rows(rng, 4)
    kv.write(k, v)
    with pytest.raises(Qwen35Error, match="not committed"):
        kv.write(k, v)
    with pytest.raises(Qwen35Error, match="cannot keep 5 of 4"):
        kv.commit(5)
    with pytest.raises(Qwen35Error, match="commit the staged rows first"):
        kv.rollback(1)
    kv.commit()
    with pytest.raises(Qwen35Error, match="overflow: 4 filled \\+ 2 new rows > capacity 5"):
        kv.write(*_rows(rng, 2))
    assert kv.host_length == 4 and kv.length.tolist() == [4] and kv.staged == 0  # nothing half-applied
    with pytest.raises(Qwen35Error, match="do not fit"):
        kv.write(*_rows(rng, 1, hkv=3))


def test_deltanet_state_staged_in_place(rng):
    """A last staged state that is ``recurrent`` itself (the fused step wrote it there): keeping
    every row copies nothing, an earlier row is copied back, and dropping them all is refused with
    nothing applied (the overwritten state cannot be restored)."""
    st = DeltaNetState(1, 2, 4, 3, conv_dim=5, kernel=4, dtype=torch.float32, device="cpu")
    window = torch.randn(1, 5, 3 + 3, generator=rng)
    earlier = [torch.randn(1, 2, 4, 3, generator=rng) for _ in range(2)]
    last = torch.randn(1, 2, 4, 3, generator=rng)
    st.recurrent.copy_(last)  # what the step wrote over the committed state
    st.stage(earlier + [st.recurrent], window, 3)
    conv = st.conv.clone()
    with pytest.raises(Qwen35Error, match="commit\\(0\\) after a fused step"):
        st.commit(0)
    assert st.staged == 3 and torch.equal(st.conv, conv)  # nothing applied, still staged
    st.commit(3)
    torch.testing.assert_close(st.recurrent, last, rtol=0, atol=0)
    torch.testing.assert_close(st.conv, window[..., 3:6], rtol=0, atol=0)
    st.stage(earlier + [st.recurrent], window, 3)
    st.commit(1)
    torch.testing.assert_close(st.recurrent, earlier[0], rtol=0, atol=0)
    torch.testing.assert_close(st.conv, window[..., 1:4], rtol=0, atol=0)


def test_deltanet_state_commit_picks_row(rng):
    st = DeltaNetState(1, 2, 4, 3, conv_dim=5, kernel=4, dtype=torch.float32, device="cpu")
    states = [torch.randn(1, 2, 4, 3, generator=rng) for _ in range(3)]
    window = torch.randn(1, 5, 3 + 3, generator=rng)
    st.stage(states, window, 3)
    st.commit(2)
    torch.testing.assert_close(st.recurrent, states[1], rtol=0, atol=0)
    torch.testing.assert_close(st.conv, window[..., 2:5], rtol=0, atol=0)
    long = torch.randn(1, 5, 3 + 7, generator=rng)
    tail, held = long[..., 7:].clone(), weakref.ref(long)
    st.stage([states[2]], long, 7)  # prefill: final state only
    del long
    gc.collect()
    assert held() is None  # staging a prompt does not hold its whole conv window until the commit
    with pytest.raises(Qwen35Error, match="only the final state"):
        st.commit(3)
    st.commit(7)
    torch.testing.assert_close(st.recurrent, states[2], rtol=0, atol=0)
    torch.testing.assert_close(st.conv, tail, rtol=0, atol=0)
    snap = (st.recurrent.clone(), st.conv.clone())
    st.stage(states, window, 3)
    st.commit(0)
    torch.testing.assert_close(st.recurrent, snap[0], rtol=0, atol=0)
    with pytest.raises(Qwen35Error, match="do not describe"):
        st.stage(states, window, 2)


def test_model_cache_layout(rng):
    sd, d = make_tiny(1, num_hidden_layers=8)
    from qwen35_fast.engine import Qwen35Config

    cfg = Qwen35Config.from_state_dict(sd)
    cache = ModelCache(cfg, batch=1, capacity=16, dtype=torch.bfloat16, device="cpu", mtp=True)
    kinds = ["kv" if isinstance(x, KVCache) else "dn" for x in cache.layers]
    assert kinds == ["dn", "dn", "dn", "kv"] * 2 and isinstance(cache.mtp, KVCache)
    assert cache.delta_states()[0].recurrent.dtype == torch.float32
    first_kv = next(x for x in cache.layers if isinstance(x, KVCache))
    assert cache.delta_states()[0].conv.shape == (1, cfg.conv_dim, 3) and first_kv.k.dtype == torch.bfloat16


def test_snapshot_restore_vs_deferred_replay(rng):
    """Both exact; prints their CPU cost for the 9B state (24 layers x [32,128,128] fp32 = 48 MiB).

    Snapshots keep the state after every verified row while the verify runs (the row-by-row
    recurrence creates those tensors anyway) and commit by one copy. Deferred replay keeps only
    the pre-verify state and, after a partial acceptance, runs the kept rows' recurrence again.
    """
    layers, heads, dk, dv, rows, keep = 24, 32, 128, 128, 4, 2
    inputs = []
    for _ in range(layers):
        q = torch.randn(1, rows, 16, dk, generator=rng)
        k = torch.randn(1, rows, 16, dk, generator=rng)
        v = torch.randn(1, rows, heads, dv, generator=rng)
        g, beta = gates(torch.randn(1, rows, heads, generator=rng), torch.randn(1, rows, heads, generator=rng),
                        -torch.rand(heads, generator=rng), torch.randn(heads, generator=rng))
        inputs.append((*prepare_qkv(q, k, v, heads), g, beta))
    start = [torch.randn(1, heads, dk, dv, generator=rng) for _ in range(layers)]
    fresh = [recurrent_rows(s, q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], b[:, :keep])[1][-1]
             for s, (q, k, v, g, b) in zip(start, inputs)]

    def snapshots():
        out = []
        for s, (q, k, v, g, b) in zip(start, inputs):
            st = DeltaNetState(1, heads, dk, dv, conv_dim=4, kernel=4, dtype=torch.float32, device="cpu")
            st.recurrent.copy_(s)
            _, states = recurrent_rows(st.recurrent, q, k, v, g, b)  # the verify itself
            st.stage(states, torch.zeros(1, 4, 3 + rows), rows)
            st.commit(keep)
            out.append(st.recurrent)
        return out

    def replay():
        out = []
        for s, (q, k, v, g, b) in zip(start, inputs):
            st = DeltaNetState(1, heads, dk, dv, conv_dim=4, kernel=4, dtype=torch.float32, device="cpu")
            st.recurrent.copy_(s)
            before = (st.recurrent.clone(), st.conv.clone())
            recurrent_rows(st.recurrent, q, k, v, g, b)  # the verify (its states are not kept)
            st.recurrent.copy_(before[0])
            st.conv.copy_(before[1])
            _, again = recurrent_rows(st.recurrent, q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], b[:, :keep])
            st.recurrent.copy_(again[-1])
            out.append(st.recurrent)
        return out

    timings = {}
    for name, fn in (("snapshots", snapshots), ("replay", replay)):
        fn()
        t0 = time.perf_counter()
        got = fn()
        timings[name] = time.perf_counter() - t0
        for a, b in zip(got, fresh):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    print(f"\n9B DeltaNet state, verify of {rows} rows keeping {keep} (CPU): "
          f"snapshots {timings['snapshots'] * 1e3:.1f} ms, deferred replay {timings['replay'] * 1e3:.1f} ms")
