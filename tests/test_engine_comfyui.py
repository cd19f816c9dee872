"""Opt-in: the engine bound to ComfyUI's own ``Qwen35`` modules (in process, CPU, tiny random weights).

Set ``QWEN35_FAST_COMFYUI=<ComfyUI checkout>`` and run with a Python that has ComfyUI's
requirements. Checks that ``bind`` accepts the real tree (BaseGenerate instance and its ``.model``),
that engine greedy tokens equal core ComfyUI's ``generate`` with ``manual_cast`` ops (its
weight-casting path, including tied logits through ``comfy.ops.cast_bias_weight``), that a
grafted MTP head keeps them, and that sampling with the same seed gives core's tokens when
top-k is off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from qwen35_fast.engine import bind, build_mtp_head, generate
from qwen35_fast.patches.comfy_bridge import comfy_weight_cast

from tests.oracles.tiny import add_mtp, make_tiny, to_layout

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run")]

BIND = dict(weight_cast=comfy_weight_cast)  # how the ComfyUI layer binds: tied logits cast by comfy.ops


@pytest.fixture(scope="module")
def comfy():
    loaded = sys.modules.get("comfy")
    where = [str(Path(x).resolve()) for x in getattr(loaded, "__path__", None) or [getattr(loaded, "__file__", "")]]
    if loaded is not None and not any(w.startswith(str(Path(COMFY).resolve())) for w in where):
        pytest.skip("another 'comfy' package (the test stub) is already imported: run this file on its own")
    sys.path.insert(0, COMFY)
    try:
        import comfy.cli_args

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        import comfy.ops
        import comfy.text_encoders.qwen35 as qwen35
    except ImportError as exc:
        pytest.skip(f"ComfyUI at {COMFY} cannot be imported here ({exc}); use ComfyUI's Python")
    return comfy.ops, qwen35


def _comfy_model(comfy, sd, d, ops_name="manual_cast"):
    ops, qwen35 = comfy
    cfg = qwen35.Qwen35Config(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
        linear_num_key_heads=d["linear_num_key_heads"], linear_num_value_heads=d["linear_num_value_heads"],
        linear_key_head_dim=d["linear_key_head_dim"], linear_value_head_dim=d["linear_value_head_dim"],
        layer_types=list(d["layer_types"]), lm_head=not d["tied"], stop_tokens=[])

    class Tiny(qwen35.Qwen35):  # ComfyUI's class without its (large) vision tower
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_layers = cfg.num_hidden_layers
            self.model = qwen35.Qwen35Transformer(cfg, device="cpu", dtype=torch.float32,
                                                  ops=getattr(ops, ops_name))
            self.dtype = torch.float32
            self.mtp = None  # newer core's own MTP head slot (built by load_clip from mtp.* tensors)

    model = Tiny()
    text = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(to_layout(text, "comfyui"), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_engine_on_comfyui_modules(comfy, rng, tied):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.5, tied=tied)
    model = _comfy_model(comfy, sd, d)
    b = bind(model)
    assert b.is_comfy and bind(model.model).transformer is model.model and b.mtp is None
    emb = torch.randn(6, d["hidden_size"], generator=rng)
    with torch.no_grad():
        core = model.generate(emb.clone(), do_sample=False, max_length=20, stop_tokens=[],
                              execution_dtype=torch.float32)
    ours = generate(model, emb, **BIND, do_sample=False, max_length=20, mtp="off", stop_tokens=[],
                    execution_dtype=torch.float32)
    assert ours.tokens == core
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model.model.mtp = build_mtp_head({k: v for k, v in sd.items() if k.startswith("mtp.")}, b.config)
    spec = generate(model, emb, **BIND, do_sample=False, max_length=20, mtp=3, stop_tokens=[],
                    execution_dtype=torch.float32)
    assert spec.tokens == core and spec.stats.drafted > 0
    kw = dict(do_sample=True, max_length=20, stop_tokens=[], execution_dtype=torch.float32, seed=5, top_k=0,
              top_p=0.9, temperature=1.0, presence_penalty=0.5)
    with torch.no_grad():
        core_s = model.generate(emb.clone(), **kw)
    assert generate(model, emb, **BIND, mtp="off", **kw).tokens == core_s
    # top-k on (the PE settings): ComfyUI draws over the top-k list in topk order; so does the engine
    kw.update(top_k=20, top_p=0.95, repetition_penalty=1.05, seed=11)
    with torch.no_grad():
        core_k = model.generate(emb.clone(), **kw)
    assert generate(model, emb, **BIND, mtp="off", **kw).tokens == core_k


def test_fused_path_on_comfyui_modules(comfy, rng):
    """ComfyUI's own modules with weights used in place (``disable_weight_init`` ops, what ComfyUI
    uses when weights need no cast): the fused plan accepts its norms, gated norm, conv and MLP and
    gives the engine's torch-path tokens (CPU, Triton interpreter), with and without MTP; the torch
    path itself equals core's tokens above (``manual_cast``). With ``manual_cast`` ops (weights cast
    per call) the plan refuses, naming why."""
    from qwen35_fast.engine.fused import FusedPlan

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.5)
    model = _comfy_model(comfy, sd, d, ops_name="disable_weight_init")
    b = bind(model)
    plan, why = FusedPlan.build(b, "cpu", torch.float32)
    if plan is None and "Triton" in why:
        pytest.skip(why)
    assert plan is not None, why
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model.model.mtp = build_mtp_head({k: v for k, v in sd.items() if k.startswith("mtp.")}, b.config)
    emb = torch.randn(11, d["hidden_size"], generator=rng)
    for mtp in ("off", 3):
        kw = dict(do_sample=False, max_length=12, mtp=mtp, stop_tokens=[], execution_dtype=torch.float32,
                  attention="torch")
        fused = generate(model, emb, **BIND, fused=True, **kw)
        assert fused.tokens == generate(model, emb, **BIND, fused=False, **kw).tokens, mtp
    cast = _comfy_model(comfy, sd, d)
    plan, why = FusedPlan.build(bind(cast), "cpu", torch.float32)
    assert plan is None and "casts or patches" in why
