"""The enhancer's swap patcher inside a real ComfyUI (CPU): ComfyUI's bookkeeping unchanged, weights exact.

``patches/swap_patcher.py`` lets ComfyUI decide every load, partial unload and unload and only changes
how the bytes move. On a CPU machine there is no GPU to move to, so the tests give ComfyUI one: a
"meta" load device (tensors with shapes and no data), ComfyUI's free-memory query answering from a
budget and the bytes its loaded models report, and ComfyUI's ``pin_memory`` recording instead of
calling ``cudaHostRegister``. A model moved to "meta" keeps no values, so every value a model has
after a round trip came back from the host mirror: the weights equal the file's bit for bit only if
the mirror kept them. Without the pack the same runs need a way back from "meta": the baseline's
modules get a test driver (zeros on the way back; the baseline's values are never compared).

Set ``QWEN35_FAST_COMFYUI=<ComfyUI checkout>`` (``scripts/test_comfyui.sh`` does, per tree).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.oracles.comfy_tree import comfy_qwen35, import_comfyui, int8_convrot
from tests.oracles.tiny import make_tiny

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run")]

META = torch.device("meta")


@pytest.fixture(scope="module")
def comfy():
    return import_comfyui(COMFY)


class FakeGPU:
    """ComfyUI's view of a GPU of ``budget`` bytes at ``META``: free memory is the budget less what the
    loaded models say they hold there; pinning is recorded (``pinned``: pointer -> bytes)."""

    def __init__(self, comfy, monkeypatch, budget: int):
        from qwen35_fast.patches import swap_patcher

        mm = self.mm = comfy.model_management
        self.budget, self.pinned = budget, {}
        monkeypatch.setattr(swap_patcher, "MIRRORED_DEVICE_TYPES", ("cuda", "meta"))
        monkeypatch.setattr(mm, "get_free_memory", self.free)
        monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False:
                            (budget, budget) if torch_total_too else budget)
        monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: [META])
        monkeypatch.setattr(mm, "minimum_inference_memory", lambda: 0)
        monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 0)
        monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
        monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 40)
        monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
        monkeypatch.setattr(mm, "pin_memory", self.pin)
        monkeypatch.setattr(mm, "unpin_memory", self.unpin)
        monkeypatch.setattr(mm, "current_loaded_models", [])

    def free(self, dev=None, torch_free_too=False):
        used = sum(m.model.loaded_size() for m in self.mm.current_loaded_models if m.model is not None)
        free = self.budget - used
        return (free, 0) if torch_free_too else free

    def pin(self, t):
        if t.device.type != "cpu" or self.is_pinned(t):  # as ComfyUI's: a pinned tensor is not pinned twice
            return False
        self.pinned[t.data_ptr()] = t.nbytes
        self.mm.TOTAL_PINNED_MEMORY += t.nbytes
        return True

    def unpin(self, t):
        size = self.pinned.pop(t.data_ptr(), None)
        if size is not None:
            self.mm.TOTAL_PINNED_MEMORY -= size
        return size is not None

    def is_pinned(self, t) -> bool:
        p = t.data_ptr()
        return any(start <= p < start + n for start, n in self.pinned.items())


def _back_from_meta(module, *args, **kwargs):
    """The baseline's device driver: torch's ``Module.to``, except that a tensor leaving "meta" comes
    back as zeros of its shape (torch cannot copy out of "meta")."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]

    def convert(t):
        if t.is_meta and device is not None and device.type == "cpu":
            if hasattr(type(t), "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
                names, ctx = t.__tensor_flatten__()
                inner = {n: torch.zeros(getattr(t, n).shape, dtype=getattr(t, n).dtype) for n in names}
                return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
            return torch.zeros(t.shape, dtype=t.dtype)
        return t.to(*args, **kwargs)

    torch.nn.Module._apply(module, convert)
    return module


def _models(comfy, int8: bool):
    """(enhancer patcher, image stand-in patcher): a tiny ComfyUI Qwen35 (int8_convrot via ComfyUI's
    MixedPrecisionOps, or manual_cast float32) and a stack of ComfyUI Linear layers."""
    sd, d = make_tiny(1234, strength=0.5)
    ops = comfy.ops
    model = comfy_qwen35((ops, comfy.text_encoders.qwen35), sd, d,
                         ops=ops.mixed_precision_ops({}, torch.float32) if int8 else ops.manual_cast,
                         layout=(lambda s: int8_convrot(s, group=16)) if int8 else None)
    mp = comfy.model_patcher
    enhancer = mp.ModelPatcher(model, load_device=META, offload_device=torch.device("cpu"))
    image = torch.nn.Sequential(*[ops.manual_cast.Linear(64, 64, bias=False) for _ in range(24)])
    image_patcher = mp.ModelPatcher(image, load_device=META, offload_device=torch.device("cpu"))
    return enhancer, image_patcher


def _state(patcher) -> dict:
    """What ComfyUI keeps about a patcher's model: loaded bytes, lowvram flag, which leaves are where."""
    from qwen35_fast.patches.host_mirror import model_leaves

    m = patcher.model
    return {"loaded": patcher.loaded_size(), "lowvram": bool(m.model_lowvram), "device": str(m.device),
            "on_meta": sorted(k for k, t in model_leaves(m) if t.is_meta)}


def _loop(comfy, enhancer, image, snap) -> list:
    """The user's loop as ComfyUI runs it: enhancer, image model, enhancer, image model, "Unload models";
    ``snap(step)`` after each step. Returns ComfyUI's loaded list after each step."""
    mm = comfy.model_management
    trace = []
    for step, load in [("enhancer", enhancer), ("image", image), ("enhancer again", enhancer),
                       ("image again", image), ("unload models", None)]:
        if load is None:
            mm.unload_all_models()
        else:
            mm.load_models_gpu([load])
        trace.append((step, [(type(lm.model.model).__name__, lm.model.loaded_size(), bool(lm.model.model.model_lowvram))
                             for lm in mm.current_loaded_models], _state(enhancer), _state(image)))
        snap(step)
    return trace


def _budget(enhancer, image) -> int:
    """A card where either model fits alone and both do not: each load evicts part of the other."""
    return int(max(enhancer.model_size(), image.model_size()) * 1.1) + min(enhancer.model_size(),
                                                                          image.model_size()) // 3


@pytest.mark.parametrize("int8", [False, True])
def test_bookkeeping_equals_comfyuis_own(comfy, monkeypatch, int8):
    """Load, partial unload, partial load and "Unload models": ComfyUI's accounting (each loaded model's
    bytes, its lowvram state, which leaves sit on the device, the loaded list) is the same with the
    pack's patcher as with ComfyUI's own, step by step."""
    from qwen35_fast.patches import swap_patcher

    traces = []
    for pack in (False, True):
        with monkeypatch.context() as mp:
            FakeGPU(comfy, mp, 0)
            enhancer, image = _models(comfy, int8)
            gpu = FakeGPU(comfy, mp, _budget(enhancer, image))
            drivers = []
            if pack:  # the mirror at once: "meta" keeps no values for a first eviction to copy back
                assert swap_patcher.install(enhancer) is None and swap_patcher.prepare(enhancer) is None
                assert type(enhancer).__name__.startswith("Qwen35Swap")
            for module in [*(() if pack else enhancer.model.modules()), *image.model.modules()]:
                module.__dict__["to"] = functools.partial(_back_from_meta, module)
                drivers.append(module)
            traces.append(_loop(comfy, enhancer, image, lambda step: None))
            assert gpu.free() >= 0
            for module in drivers:
                module.__dict__.pop("to")
    without, with_pack = traces
    partial = [step for step, loaded, *_ in without if any(low for _n, _b, low in loaded)]
    assert partial, "the budget must force partial loads, or the test proves nothing"
    assert with_pack == without


def test_round_trips_keep_every_weight_and_copy_nothing_back(comfy, monkeypatch):
    """With the pack, every weight is the file's, bit for bit, after each move (a move to "meta" keeps no
    values: only the mirror can bring them back); the host copies live once, in pinned chunks
    registered through ComfyUI's ``pin_memory``; eviction moves bytes with no copy."""
    from qwen35_fast.patches import swap_patcher
    from qwen35_fast.patches.host_mirror import model_leaves

    FakeGPU(comfy, monkeypatch, 0)
    enhancer, image = _models(comfy, int8=True)
    gpu = FakeGPU(comfy, monkeypatch, _budget(enhancer, image))
    original = {k: t.clone() for k, t in model_leaves(enhancer.model)}
    assert any("_qdata" in k for k in original) and any(t.dtype == torch.int8 for t in original.values())
    swap_patcher.install(enhancer)
    assert swap_patcher.prepare(enhancer) is None  # "meta" keeps no values for a first eviction to copy back
    for module in image.model.modules():
        module.__dict__["to"] = functools.partial(_back_from_meta, module)
    checked, device_bytes = [], [0]

    def snap(step):
        host = {k: t for k, t in model_leaves(enhancer.model) if not t.is_meta}
        for k, t in host.items():
            assert t.dtype == original[k].dtype and torch.equal(t, original[k]), (step, k)
            assert gpu.is_pinned(t), (step, k, "a host weight outside the pinned mirror")
        checked.append((step, len(host)))
        mirror = swap_patcher.mirror_of(enhancer.model)
        assert sum(gpu.pinned.get(c.data_ptr(), 0) for c in mirror.chunks) == mirror.pinned_bytes > 0
        assert not mirror.missing
        on_device = sum(t.numel() * t.element_size() for _k, t in model_leaves(enhancer.model) if t.is_meta)
        moved, device_bytes[0] = on_device - device_bytes[0], on_device
        if step == "enhancer again":  # what the node's status says after this prompt's generation, once
            note, line = swap_patcher.status_report(enhancer.model)
            assert note is None and line.startswith("Weights back on the GPU in ")
            assert swap_patcher.last_move(enhancer.model)["bytes"] == moved > 0
            assert swap_patcher.status_report(enhancer.model) == (None, None)

    _loop(comfy, enhancer, image, snap)
    assert checked[-1] == ("unload models", len(original))
    moves = swap_patcher.last_move(enhancer.model)
    assert moves["direction"] == "to the host" and moves["copied"] == 0 and moves["kept"] > 0
    # the image model's own moves are ComfyUI's: untouched by the pack
    assert not isinstance(image, swap_patcher.SwapMixin)


def test_a_failed_load_leaves_the_model_whole_on_the_host(comfy, monkeypatch):
    """Out of memory in the middle of the enhancer's load: ComfyUI's own recovery (``partially_load``
    detaches the model) brings every weight back to the host, exact, and the next load works."""
    from qwen35_fast.patches import swap_patcher
    from qwen35_fast.patches.host_mirror import HostMirror, model_leaves

    FakeGPU(comfy, monkeypatch, 0)
    enhancer, _image = _models(comfy, int8=True)
    FakeGPU(comfy, monkeypatch, enhancer.model_size() * 4)
    original = {k: t.clone() for k, t in model_leaves(enhancer.model)}
    swap_patcher.install(enhancer)
    assert swap_patcher.prepare(enhancer) is None
    real, calls = HostMirror.move, []

    def failing(self, key, t, device):
        if device.type == "meta" and not getattr(type(t), "__tensor_flatten__", None):
            calls.append(key)
            if len(calls) == len(original) // 2:
                raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, key, t, device)

    mm = comfy.model_management
    with monkeypatch.context() as mp:
        mp.setattr(HostMirror, "move", failing)
        with pytest.raises(torch.OutOfMemoryError):
            mm.load_models_gpu([enhancer])
    leaves = dict(model_leaves(enhancer.model))
    assert not any(t.is_meta for t in leaves.values()), "half on the device after a failed load"
    assert all(torch.equal(leaves[k], original[k]) for k in original)
    assert enhancer.loaded_size() == 0 and not mm.current_loaded_models
    mm.load_models_gpu([enhancer])
    assert enhancer.loaded_size() == enhancer.model_size()
    assert all(t.is_meta for t in dict(model_leaves(enhancer.model)).values())


@pytest.mark.parametrize("case", ["lora", "no_pinning", "ram"])
def test_comfyuis_own_path_runs_and_says_why_once(comfy, monkeypatch, caplog, case):
    """A CLIP with weight patches, pinned memory off, or too little host RAM: ComfyUI moves the weights
    itself (no mirror is built) and the log says why, once per model."""
    import psutil
    from qwen35_fast.patches import swap_patcher

    FakeGPU(comfy, monkeypatch, 0)
    enhancer, _image = _models(comfy, int8=False)
    FakeGPU(comfy, monkeypatch, enhancer.model_size() * 4)
    mm = comfy.model_management
    swap_patcher.install(enhancer)
    if case == "lora":
        key = next(k for k in enhancer.model.state_dict() if k.endswith("mlp.down_proj.weight"))
        enhancer.add_patches({key: (torch.zeros_like(enhancer.model.state_dict()[key]),)}, 1.0)
        expect = "weight patches"
    elif case == "no_pinning":
        monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1)
        expect = "--disable-pinned-memory"
    else:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1 << 20})())
        expect = "free RAM"
    for module in enhancer.model.modules():
        module.__dict__["to"] = functools.partial(_back_from_meta, module)
    for _ in range(2):
        mm.load_models_gpu([enhancer])
        mm.unload_all_models()
    assert swap_patcher.mirror_of(enhancer.model) is None
    said = [r.getMessage() for r in caplog.records if "ComfyUI's own path" in r.getMessage()]
    assert len(said) == 1 and expect in said[0], said
    assert expect in swap_patcher.move_note(enhancer.model)
    note, line = swap_patcher.status_report(enhancer.model)  # the node's status says it once too
    assert expect in note and line is None and swap_patcher.status_report(enhancer.model) == (None, None)


def test_the_mirror_replaces_comfyuis_pinned_copies(comfy, monkeypatch):
    """The enhancer's first load on a card with room for part of it is ComfyUI's own: it pins the
    pageable copies it leaves on the host. When the mirror is built (``prepare``, or the first move
    to the host) the host holds each weight once, in the mirror's chunks, with the file's values, and
    ComfyUI's own registrations of the pageable copies are released (its ``unpin_all_weights``)."""
    from qwen35_fast.patches import swap_patcher
    from qwen35_fast.patches.host_mirror import model_leaves

    FakeGPU(comfy, monkeypatch, 0)
    enhancer, _image = _models(comfy, int8=True)
    gpu = FakeGPU(comfy, monkeypatch, enhancer.model_size() // 2)
    original = {k: t.clone() for k, t in model_leaves(enhancer.model)}
    swap_patcher.install(enhancer)
    mm = comfy.model_management
    mm.load_models_gpu([enhancer])
    assert enhancer.model.model_lowvram and swap_patcher.mirror_of(enhancer.model) is None
    assert enhancer.pinned and mm.TOTAL_PINNED_MEMORY > 0, "ComfyUI pins what a partial load leaves on the host"
    assert swap_patcher.prepare(enhancer) is None
    mirror = swap_patcher.mirror_of(enhancer.model)
    assert not enhancer.pinned and mm.TOTAL_PINNED_MEMORY == mirror.pinned_bytes
    assert set(gpu.pinned) == {c.data_ptr() for c in mirror.chunks}
    host = {k: t for k, t in model_leaves(enhancer.model) if not t.is_meta}
    assert host
    for k, t in host.items():
        assert torch.equal(t, original[k]) and gpu.is_pinned(t), k
