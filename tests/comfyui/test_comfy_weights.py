"""The ComfyUI weight hook (``patches/comfy_weights.py``): which module weights the decode kernels read
in place and why not, on comfy-kitchen's real ``QuantizedTensor``; and the residency step."""

import sys
import types

import pytest
import torch
from qwen35_fast.patches import comfy_weights
from qwen35_fast.patches.comfy_weights import Resolver, make_resident

ck = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt): ComfyUI's int8 type")
CPU, BF16 = torch.device("cpu"), torch.bfloat16


def int8_linear(n=8, k=256, convrot=True, layout="TensorWiseINT8Layout"):
    """A Linear as ComfyUI's MixedPrecisionOps leaves it: a Parameter-wrapped QuantizedTensor."""
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    params = ck.TensorWiseINT8Layout.Params(scale=torch.rand(n, 1), orig_dtype=BF16, orig_shape=(n, k),
                                            convrot=convrot, convrot_groupsize=256)
    mod = torch.nn.Linear(k, n, bias=False)
    mod.weight = torch.nn.Parameter(ck.QuantizedTensor(q, layout, params), requires_grad=False)
    mod.comfy_cast_weights = mod.comfy_force_cast_weights = True  # as ModelPatcher.load writes them
    mod.weight_function, mod.bias_function = [], []
    return mod, q


def dense_linear(dtype=BF16):
    mod = torch.nn.Linear(16, 4, bias=False).to(dtype)
    mod.comfy_cast_weights = mod.comfy_force_cast_weights = True
    mod.weight_function, mod.bias_function = [], []
    return mod


def test_int8_convrot_read_in_place():
    mod, q = int8_linear()
    plain, why = Resolver().linear(mod, CPU, BF16)
    assert why is None and plain.quantized
    assert plain.weight.data_ptr() == q.data_ptr()  # the module's own storage, no copy
    assert plain.scale.shape == (8,) and plain.scale.dtype == torch.float32
    assert plain.convrot == 256
    plain2, _ = Resolver().linear(int8_linear(convrot=False)[0], CPU, BF16)
    assert plain2.convrot == 0


def fp8_linear(n=8, k=64, dtype=torch.float8_e4m3fn, layout="TensorCoreFP8E4M3Layout", scale=None):
    """A Linear holding ComfyUI's fp8 QuantizedTensor (``float8_e4m3fn`` / ``float8_e5m2`` files)."""
    q = torch.randn(n, k).to(dtype)
    params = ck.TensorCoreFP8Layout.Params(scale=torch.tensor(0.02) if scale is None else scale, orig_dtype=BF16,
                                           orig_shape=(n, k))
    mod = torch.nn.Linear(k, n, bias=False)
    mod.weight = torch.nn.Parameter(ck.QuantizedTensor(q, layout, params), requires_grad=False)
    mod.comfy_cast_weights = mod.comfy_force_cast_weights = True
    mod.weight_function, mod.bias_function = [], []
    return mod, q


@pytest.mark.parametrize("dtype, layout", [(torch.float8_e4m3fn, "TensorCoreFP8Layout"),
                                           (torch.float8_e4m3fn, "TensorCoreFP8E4M3Layout"),
                                           (torch.float8_e5m2, "TensorCoreFP8E5M2Layout")])
def test_fp8_read_in_place(dtype, layout, monkeypatch):
    mod, q = fp8_linear(dtype=dtype, layout=layout)
    plain, why = Resolver().linear(mod, CPU, BF16)
    assert why is None and plain.quantized and plain.convrot == 0
    assert plain.weight.data_ptr() == q.data_ptr() and plain.weight.dtype == dtype
    assert plain.scale.shape == (1,) and plain.scale.dtype == torch.float32
    # a per-row fp8 scale (no ComfyUI layout writes one) or the wrong storage stays on the module path
    assert "not one float32" in Resolver().linear(fp8_linear(scale=torch.rand(8))[0], CPU, BF16)[1]
    assert "does not hold" in Resolver().linear(fp8_linear(dtype=torch.float8_e5m2)[0], CPU, BF16)[1]
    # where the GEMV cannot widen fp8, the reason says which GPUs can
    from qwen35_fast.kernels import capabilities
    monkeypatch.setattr(capabilities, "interpreting", lambda: False)
    assert "CUDA" in Resolver().linear(mod, CPU, BF16)[1]


def test_dense_read_in_place_despite_the_flags():
    mod = dense_linear()
    plain, why = Resolver().linear(mod, CPU, BF16)
    assert why is None and plain.weight.data_ptr() == mod.weight.data_ptr()
    assert Resolver().module_call_reason(mod) is None  # a resident weight's cast is replayed by a graph


@pytest.mark.parametrize("fmt", ["dense", "int8", "dtype"])
def test_graph_guards_of_the_module_path(fmt):
    """Without the fused kernels a graph captures every module call. A resident model whose modules
    merely may cast (``comfy_cast_weights``, a bf16 weight called in float32 included) can be
    captured; a patch (LoRA), DynamicVRAM streaming, lowvram patches or an unload (weights off the
    GPU) each stop it, with the reason; a reload (new, resident storage) can be captured again."""
    from qwen35_fast.engine.graphs import module_blocker

    def model():
        mods = [int8_linear()[0] if fmt == "int8" else dense_linear(torch.float16 if fmt == "dtype" else BF16)
                for _ in range(3)]
        return types.SimpleNamespace(transformer=torch.nn.Sequential(*mods), mtp=None, weights=Resolver())

    binding = model()
    assert module_blocker(binding, CPU) is None
    layer = binding.transformer[1]
    layer.weight_function = [lambda w: w]
    assert "1: it has per-call weight patches (LoRA or hooks)" == module_blocker(binding, CPU)
    layer.weight_function = []
    layer._v = object()
    assert "DynamicVRAM" in module_blocker(binding, CPU)
    del layer._v
    layer.weight_lowvram_function = object()
    assert "lowvram" in module_blocker(binding, CPU)
    del layer.weight_lowvram_function
    layer.weight = torch.nn.Parameter(torch.empty(4, 16, dtype=BF16, device="meta"), requires_grad=False)
    assert "lives on meta, not cpu" in module_blocker(binding, CPU)  # unloaded
    assert module_blocker(model(), CPU) is None  # reloaded


@pytest.mark.parametrize("case, expect", [
    ("dynamic", "DynamicVRAM"), ("lora", "per-call weight patches"), ("lowvram", "lowvram weight patches"),
    ("offloaded", "lives on meta"), ("dtype", "cast per call"), ("mxfp8", "TensorCoreMXFP8Layout"),
    ("bias", "its bias is torch.float32"),
])
def test_what_stays_on_the_module_path(case, expect):
    mod = int8_linear(layout="TensorCoreMXFP8Layout")[0] if case == "mxfp8" else dense_linear()
    if case == "dynamic":
        mod._v = object()
    elif case == "lora":
        mod.weight_function = [lambda w: w]
    elif case == "lowvram":
        mod.weight_lowvram_function = object()
    elif case == "offloaded":
        mod.weight = torch.nn.Parameter(torch.empty(4, 16, dtype=BF16, device="meta"), requires_grad=False)
    elif case == "dtype":
        mod = dense_linear(torch.float16)
    elif case == "bias":
        mod.bias = torch.nn.Parameter(torch.zeros(4))
    plain, why = Resolver().linear(mod, CPU, BF16)
    assert plain is None and expect in why, why


class FakePatcher:
    def __init__(self, loaded, total, dynamic=False):
        self.loaded, self.total, self.dynamic, self.load_device = loaded, total, dynamic, torch.device("cuda")

    def is_dynamic(self):
        return self.dynamic

    def loaded_size(self):
        return self.loaded

    def model_size(self):
        return self.total


@pytest.fixture
def fake_mm(monkeypatch):
    """A stand-in for ``comfy.model_management`` recording ``load_models_gpu`` calls."""
    mm = types.SimpleNamespace(calls=[], free=0)
    mm.is_device_cpu = lambda d: torch.device(d).type == "cpu"
    mm.get_free_memory = lambda d: mm.free
    mm.load_models_gpu = lambda models, **kw: mm.calls.append((models, kw))
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    return mm


def test_make_resident(fake_mm, caplog):
    gb = 2**30
    assert make_resident(None) is None
    assert make_resident(FakePatcher(9 * gb, 9 * gb)) is None and not fake_mm.calls  # already resident
    fake_mm.free = 8 * gb
    partly = FakePatcher(3 * gb, 9 * gb)
    assert make_resident(partly) is None
    assert fake_mm.calls == [([partly], {"force_full_load": True})]  # ComfyUI's own full load
    fake_mm.free, fake_mm.calls = 2 * gb, []
    why = make_resident(FakePatcher(3 * gb, 9 * gb))
    assert not fake_mm.calls and "only 3.0 of 9.0 GB" in why
    why = make_resident(FakePatcher(0, 9 * gb, dynamic=True))
    assert "DynamicVRAM" in why and "--disable-dynamic-vram" in why and "Length-aware decode (Qwen3.5)" in why
    why = make_resident(FakePatcher(0, 9 * gb, dynamic=True), "it does not fit")
    assert "DynamicVRAM" in why and why.endswith("it does not fit")
    assert not fake_mm.calls
    assert comfy_weights.per_call_work(dense_linear()) is None


def test_norm_scale_rounds_as_each_norm_class_does():
    """ComfyUI's RMSNorm rounds (1 + w) in the weight's dtype; a norm the engine built (a grafted MTP
    head) in float32, as its own forward does."""
    from qwen35_fast.engine.modules import RMSNorm

    w = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 0.05
    engine = RMSNorm(64, add=True)
    engine.weight.data = w.to(BF16)
    comfy_norm = type("RMSNorm", (RMSNorm,), {"__module__": "comfy.ldm.common_dit"})(64, add=True)
    comfy_norm.weight.data = w.to(BF16)
    exact = w.to(BF16).float() + 1.0
    assert torch.equal(Resolver().norm_scale(engine, BF16), exact)
    assert torch.equal(Resolver().norm_scale(comfy_norm, BF16), (w.to(BF16) + 1.0).float())
    assert not torch.equal(Resolver().norm_scale(comfy_norm, BF16), exact)  # bf16 rounding of 1 + w


class FakeClip:
    """A CLIP as ``resident_clip`` sees it: ``clone()`` and a patcher."""

    def __init__(self, patcher):
        self.patcher, self.cond_stage_model = patcher, getattr(patcher, "model", None)

    def clone(self):
        return FakeClip(self.patcher)


class FakeDynamicPatcher:
    """A DynamicVRAM patcher: ``clone(disable_dynamic=True)`` reloads (a new model) unless given a
    ``model_override``; ``fail`` makes the reload raise."""

    def __init__(self, size, init=True, fail=False):
        self.model, self.size, self.fail = torch.nn.Module(), size, fail
        self.load_device, self.parent, self.reloads = torch.device("cuda"), None, 0
        self.cached_patcher_init = (object, ()) if init else None

    def is_dynamic(self):
        return True

    def model_size(self):
        return self.size

    def clone(self, disable_dynamic=False, model_override=None):
        assert disable_dynamic
        if model_override is None:
            if self.fail:
                raise RuntimeError("the file is gone\nsecond line")
            self.reloads += 1
            model_override = (torch.nn.Module(), ())
        n = FakePatcher(0, self.size)
        n.model, n.parent = model_override[0], self
        n.get_clone_model_override = lambda: (n.model, ())
        return n


@pytest.fixture
def gpu_16gb(fake_mm):
    fake_mm.get_total_memory = lambda d: 16 * 2**30
    fake_mm.minimum_inference_memory = lambda: 0.8 * 2**30
    return fake_mm


def test_resident_clip_reloads_a_dynamic_clip_once(gpu_16gb):
    gb = 2**30
    plain = FakeClip(FakePatcher(9 * gb, 9 * gb))
    assert comfy_weights.resident_clip(plain) == (plain, None)
    clip = FakeClip(FakeDynamicPatcher(10 * gb))
    first, why = comfy_weights.resident_clip(clip)
    assert why is None and first is not clip and clip.patcher.reloads == 1
    owner = getattr(clip.patcher.model, comfy_weights.RESIDENT_ATTR)
    assert first.patcher.parent is owner and first.patcher.model is owner.model is first.cond_stage_model
    assert owner.parent is None and owner.model is not clip.patcher.model
    second, why = comfy_weights.resident_clip(clip)
    assert why is None and clip.patcher.reloads == 1  # the same weights, not a second copy
    assert second.patcher is not first.patcher and second.cond_stage_model is first.cond_stage_model


def test_resident_clip_leaves_a_dynamic_clip_streamed_and_says_why(gpu_16gb):
    gb = 2**30
    big = FakeClip(FakeDynamicPatcher(14 * gb))  # 14 * 1.1 + 0.8 > 16
    clip, why = comfy_weights.resident_clip(big)
    assert clip is big and "does not fit whole on this GPU (16.0 GB" in why and big.patcher.reloads == 0
    lost = FakeClip(FakeDynamicPatcher(10 * gb, init=False))
    clip, why = comfy_weights.resident_clip(lost)
    assert clip is lost and "cached_patcher_init" in why and "--disable-dynamic-vram" in why
    broken = FakeClip(FakeDynamicPatcher(10 * gb, fail=True))
    clip, why = comfy_weights.resident_clip(broken)
    assert clip is broken and "RuntimeError: the file is gone)" in why and "--disable-dynamic-vram" in why
    assert not hasattr(broken.patcher.model, comfy_weights.RESIDENT_ATTR)  # nothing half-applied


@pytest.mark.parametrize("fmt, layout", [("convrot_w4a4", "TensorCoreConvRotW4A4Layout"),
                                         ("nvfp4", "TensorCoreNVFP4Layout")])
def test_4bit_read_in_place(fmt, layout):
    """ComfyUI's 4-bit weights (as its loader leaves them): a PlainLinear whose packed record holds the
    module's own tensors (no copy), counted by format; a transposed one stays on the module, said why."""
    kw = {"convrot_groupsize": 64} if fmt == "convrot_w4a4" else {}
    qt = ck.QuantizedTensor.from_float(torch.randn(20, 256), layout, **kw)
    mod = torch.nn.Linear(256, 20, bias=False)
    mod.weight = torch.nn.Parameter(qt, requires_grad=False)
    mod.comfy_cast_weights = mod.comfy_force_cast_weights = True
    mod.weight_function, mod.bias_function = [], []
    plain, why = Resolver().linear(mod, CPU, BF16)
    assert why is None and plain.quantized and plain.kind == fmt and plain.shape == (20, 256)
    assert plain.packed.qdata.data_ptr() == qt._qdata.data_ptr()
    assert plain.convrot == (64 if fmt == "convrot_w4a4" else 0)
    mod.weight = torch.nn.Parameter(qt.t(), requires_grad=False)
    assert "transposed" in Resolver().linear(mod, CPU, BF16)[1]
