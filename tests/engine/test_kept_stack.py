"""The decode stack kept between generations (``engine/held.py``): reused only over the same
weights, exact after reuse, pinning no weight at rest, freed on release and with its model.

Oracles: a generation with ``cache_fill`` set (never kept, a fresh cache whose unfilled slots are
NaN) and the module path (``fused=False``) of the same model.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import qwen35_fast.engine.held as held
import torch
from qwen35_fast.engine import generate
from qwen35_fast.engine.mtp_auto import DepthController
from torch.multiprocessing.reductions import StorageWeakRef

from tests.engine.test_mtp_auto import StandIn, simulate
from tests.oracles.tiny import add_mtp, engine_model, make_tiny

FRESH = {"cache_fill": float("nan")}  # not kept, and proves the fresh cache's unfilled slots unread


def _model(tmp_path, seed, layers=4):
    sd, d = make_tiny(seed, strength=0.3, vocab_size=64, hidden_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    return engine_model(add_mtp(sd, d, seed + 1), tmp_path, dtype=torch.float32, device="cpu")


def _gen(model, prompt, **kw):
    kw = {"do_sample": False, "max_length": 12, "stop_tokens": [], "mtp": 3} | kw
    return generate(model, prompt, **kw)


def _prompt(seed, n=9):
    return torch.randn(1, n, 128, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mtp", ["off", 3, "auto"])
def test_a_kept_stack_serves_the_next_prompt_exactly(tmp_path, test_seed, mtp):
    """A second prompt runs on the first one's stack (the same runner object, its cache emptied)
    and makes the tokens a fresh stack makes; a third, longer than the kept cache, gets a new one."""
    model = _model(tmp_path, test_seed % 1000)
    first = _gen(model, _prompt(1), mtp=mtp)
    (runner,) = held.kept_stacks()
    second = _gen(model, _prompt(2), mtp=mtp)
    assert "kept from the last generation" in second.stats.decode_path
    assert held.kept_stacks() == [runner]
    assert second.tokens == _gen(model, _prompt(2), mtp=mtp, **FRESH).tokens
    assert first.tokens != second.tokens  # the prompts lead elsewhere: stale state would show
    long = _gen(model, _prompt(3, n=held.CAPACITY_STEP), mtp=mtp, max_length=4)
    assert "kept" not in long.stats.decode_path and held.kept_stacks() != [runner]
    assert long.tokens == _gen(model, _prompt(3, n=held.CAPACITY_STEP), mtp=mtp, max_length=4, **FRESH).tokens


def test_settings_or_a_moved_weight_build_a_new_stack(tmp_path, test_seed):
    model = _model(tmp_path, test_seed % 1000)
    _gen(model, _prompt(1))
    assert "kept" in _gen(model, _prompt(1), mtp="off").stats.decode_path  # a stack with MTP serves off
    held.release_all()
    _gen(model, _prompt(1), mtp="off")
    assert "kept" not in _gen(model, _prompt(1)).stats.decode_path  # MTP off's has no MTP cache
    assert "kept" not in _gen(model, _prompt(1), attention="torch").stats.decode_path
    with torch.inference_mode():  # as ComfyUI runs nodes: its tensors refuse in-place updates outside it
        _gen(model, _prompt(1))
        assert "kept" in _gen(model, _prompt(2)).stats.decode_path
    assert "kept" not in _gen(model, _prompt(2)).stats.decode_path
    lin = model.model.layers[1].mlp.up_proj
    lin.weight = torch.nn.Parameter(lin.weight.detach() * 1.5, requires_grad=False)  # a reload or a patch
    moved = _gen(model, _prompt(1))
    assert "kept" not in moved.stats.decode_path
    assert moved.tokens == _gen(model, _prompt(1), **FRESH).tokens


def test_the_fused_plan_at_rest_pins_no_weight_and_sees_in_place_patches(tmp_path, test_seed):
    """Fused kernels (Triton interpreter): at rest no tensor of the kept stack shares the model's
    storage, so a weight moved away (ComfyUI's partial unload: ``param.data`` replaced) is freed;
    reused, the plan reads the weights again, and a norm weight changed in place is seen."""
    model = _model(tmp_path, test_seed % 1000)
    prompt = _prompt(4)
    before = _gen(model, prompt, fused=True, max_length=6)
    (runner,) = held.kept_stacks()
    _, storages = held._fingerprint(runner.binding)
    reachable = held._walk_tensors(runner)
    assert reachable and not [t for t in reachable if t.untyped_storage().data_ptr() in storages]
    with torch.no_grad():  # the plan's norm scales are derived (1 + w): its copies must follow
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.copy_(torch.randn(128, generator=torch.Generator().manual_seed(5)))
    patched = _gen(model, prompt, fused=True, max_length=6)
    assert "kept from the last generation" in patched.stats.decode_path
    assert patched.tokens == _gen(model, prompt, fused=False, max_length=6, **FRESH).tokens != before.tokens
    gate = model.model.layers[1].mlp.gate_proj.weight
    old = StorageWeakRef(gate.untyped_storage())
    gate.data = gate.data.clone()
    gc.collect()
    assert old.expired()


def test_release_frees_the_stack_and_the_model_frees_it_too(tmp_path, test_seed):
    model = _model(tmp_path, test_seed % 1000)
    _gen(model, _prompt(1))
    ref = weakref.ref(held.kept_stacks()[0])
    assert held.release_within(model) == 1 and ref() is None  # no cycle keeps it: freed at once
    assert held.release_within(model) == 0
    _gen(model, _prompt(1))
    clone = copy.deepcopy(model)  # a deep copy of the model does not copy the stack
    assert getattr(clone.model, held.ATTR) is None
    assert _gen(clone, _prompt(1)).tokens == _gen(model, _prompt(1), **FRESH).tokens
    ref, model_ref = weakref.ref(held.kept_stacks()[0]), weakref.ref(model)
    del model, clone
    gc.collect()
    assert model_ref() is None and ref() is None and held.kept_stacks() == []


def test_one_stack_per_device_and_a_memory_bound(tmp_path, test_seed, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _model(tmp_path / "a", test_seed % 1000), _model(tmp_path / "b", test_seed % 1000 + 7)
    _gen(a, _prompt(1))
    _gen(b, _prompt(1))
    assert [r.binding.transformer for r in held.kept_stacks()] == [b.model]
    monkeypatch.setattr(held, "REST_BYTES_CPU", 1024)  # below one cache: not kept
    _gen(a, _prompt(1))
    assert [r.binding.transformer for r in held.kept_stacks()] == [b.model]


def test_depths_a_kept_stack_has_are_switched_to_at_once():
    """Every draft kept, drafting at depth 1, a capture worth 100 plain steps: without graphs the
    controller waits until the rest of the generation repays the capture (``test_mtp_auto``); with
    the kept stack's graphs of depth 5 it goes there within a few cycles (once its estimates of the
    deeper positions have risen from the prior)."""
    def first_switch(ready) -> tuple[int, int]:
        controller = DepthController(5, StandIn(0.2, capture=100.0), ready=ready)
        depths = simulate(controller, [1.0] * 5, 300, seed=0)
        i = next((i for i, k in enumerate(depths) if k != 1), len(depths))
        return i, depths[i]

    assert first_switch(set())[0] >= 375
    assert first_switch({5}) == (6, 5)
