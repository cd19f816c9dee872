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

import pytest
import torch
from qwen35_fast.engine import bind, build_mtp_head, generate
from qwen35_fast.patches.comfy_bridge import WEIGHTS, comfy_weight_cast

from tests.oracles.comfy_tree import comfy_qwen35, fp8_scaled, import_comfyui, int8_convrot
from tests.oracles.tiny import add_mtp, make_tiny

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run")]

#: How the ComfyUI layer binds: tied logits cast by comfy.ops, weights read in place by its resolver.
BIND = dict(weight_cast=comfy_weight_cast, weights=WEIGHTS)


@pytest.fixture(scope="module")
def comfy():
    c = import_comfyui(COMFY)
    return c.ops, c.text_encoders.qwen35


@pytest.mark.parametrize("tied", [False, True])
def test_engine_on_comfyui_modules(comfy, rng, tied):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.5, tied=tied)
    model = comfy_qwen35(comfy, sd, d)
    b = bind(model)
    assert bind(model.model).transformer is model.model and b.mtp is None
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
    _assert_keyed_draws(model, emb, kw)
    # top-k on (the PE settings)
    kw.update(top_k=20, top_p=0.95, repetition_penalty=1.05, seed=11)
    _assert_keyed_draws(model, emb, kw)


def _assert_keyed_draws(model, emb, kw):
    """Sampled, MTP off and depth 3: the same tokens (one seed), each the keyed draw (``tests/oracles/
    keyed_draw``) at its position from ComfyUI's own distribution (``comfy_distribution``) of ComfyUI's own
    logits, a cache-free forward of its modules over the prompt and the tokens before it (a near-tie of
    the race, under 1e-6 apart, may go either way)."""
    from tests.oracles import keyed_draw
    from tests.oracles.comfy_sampling import comfy_distribution

    off = generate(model, emb, **BIND, mtp="off", **kw).tokens
    assert generate(model, emb, **BIND, mtp=3, **kw).tokens == off
    with torch.no_grad():
        ids = torch.tensor([off[:-1]], dtype=torch.long)
        x = torch.cat([emb.unsqueeze(0), model.model.embed_tokens(ids).float()], dim=1)
        h = model.model.forward(None, embeds=x, attention_mask=None)[0]
        logits = [model.logits(h[:, : emb.shape[0] + i])[0, -1].float() for i in range(len(off))]
    settings = {k: kw.get(k, d) for k, d in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0),
                                              ("repetition_penalty", 1.0), ("presence_penalty", 0.0))}
    for i, token in enumerate(off):
        probs = comfy_distribution(logits[i], off[:i], **settings)
        want, margin = keyed_draw.draw(probs, kw["seed"], emb.shape[0] + i)
        assert token == want or margin < 1e-6, (i, token, want, margin)


def test_twelve_auto_runs_with_one_seed_give_one_text_on_comfyuis_modules(comfy, rng, monkeypatch):
    """ComfyUI's own ``Qwen35`` modules with an MTP head, the enhancer's sampled settings, one seed,
    ``mtp="auto"`` 12 times with depth choices that differ from run to run (the cycle costs switch at
    another period each run, as wall-clock costs do): one text, MTP off's."""
    import qwen35_fast.engine.generation as generation

    from tests.engine.test_engine_sampled import Switching

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.5)
    model = comfy_qwen35(comfy, sd, d)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model.model.mtp = build_mtp_head({k: v for k, v in sd.items() if k.startswith("mtp.")}, bind(model).config)
    emb = torch.randn(6, d["hidden_size"], generator=rng)
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5, seed=42, max_length=48,
              stop_tokens=[], execution_dtype=torch.float32)
    off = generate(model, emb, **BIND, mtp="off", **kw).tokens
    texts, paths = set(), set()
    for run in range(12):
        monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth, run=run: Switching(3 + 4 * run))
        got = generate(model, emb, **BIND, mtp="auto", **kw)
        texts.add(tuple(got.tokens))
        paths.add(tuple(sorted(got.stats.mtp_depths.items())))
    assert texts == {tuple(off)}
    assert len(paths) >= 3, paths


@pytest.mark.parametrize("fmt", ["float", pytest.param("int8_convrot", marks=pytest.mark.kitchen)] +
                         [pytest.param(f, marks=pytest.mark.one_tree) for f in ("int8_convrot256", "float8_e4m3fn",
                                                                                 "float8_e5m2")])
def test_fast_path_on_comfyui_loaded_modules(comfy, rng, fmt, monkeypatch):
    """ComfyUI's own modules as its loader leaves them (``manual_cast`` ops, or ``MixedPrecisionOps``
    with int8_tensorwise + ConvRot or per-tensor fp8 weights; ``comfy_cast_weights`` / ``comfy_force_cast_weights`` set
    as ``ModelPatcher.load`` writes them on a CLIP): the fused plan reads every projection in place (nothing left
    on the module path) and its greedy tokens, MTP off and depth 3, equal the module path's, where
    ComfyUI itself dequantizes (``_full_precision_mm``: weight-only, like the fast path). CPU, Triton
    interpreter. ``int8_convrot256``: ComfyUI's default group of 256 on a model 256 wide (head_dim 256),
    so the norm, SiLU and gate kernels and the DeltaNet step's gated norm rotate in their own tiles,
    and the products that feed a norm split over K (float32 partials summed by the norm); it reads
    the weights as ``int8_convrot`` does, and its cost (about 2 minutes on 2 CPU cores) is the pack's
    kernels interpreted, so ``scripts/test_comfyui.sh`` runs it on one tree (``one_tree``). So do the
    fp8 cases (about a minute each): the newer trees are 0.29.0 with newer text-encoder files, and
    their fp8 loading (``quant_ops.py``, ``MixedPrecisionOps``) is 0.29.0's; ``float`` binds every
    tree's module tree, ``int8_convrot`` every tree's comfy-kitchen (``kitchen``)."""
    from qwen35_fast.engine.fused import FusedPlan
    from qwen35_fast.kernels import convrot_triton, deltanet_step, gemv, launch

    ops, _ = comfy
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    wide = dict(hidden_size=256, intermediate_size=256, head_dim=256, linear_value_head_dim=64) \
        if fmt == "int8_convrot256" else {}
    sd, d = make_tiny(seed, strength=0.5, **wide)
    if wide:
        # every product at 64-wide tiles and 2 K ranges: K 256 gives 2 partials
        monkeypatch.setattr(launch, "gemv", lambda n, k, quant, rows, device, **kw: ((16, 64, 4, 2), 2))
    group = 256 if wide else 16
    fp8 = getattr(torch, fmt) if fmt.startswith("float8") else None
    layout = None if fmt == "float" else (lambda sd: fp8_scaled(sd, fp8)) if fp8 else \
        (lambda sd: int8_convrot(sd, group=group))
    model = comfy_qwen35(comfy, sd, d, ops=ops.manual_cast if layout is None else ops.mixed_precision_ops(
        {}, torch.float32), layout=layout)
    for m in model.modules():  # the flags ModelPatcher.load writes on a CLIP's modules (say "may cast")
        m.comfy_force_cast_weights = True
        if hasattr(m, "comfy_cast_weights"):
            m.comfy_cast_weights = True
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model.model.mtp = build_mtp_head({k: v for k, v in sd.items() if k.startswith("mtp.")}, bind(model).config)
    b = bind(model, **BIND)
    plan, why = FusedPlan.build(b, "cpu", torch.float32)
    if plan is None and "Triton" in why:
        pytest.skip(why)
    assert plan is not None, why
    assert plan.unresolved == {}, plan.describe()
    if layout is not None:
        kind = fmt if fp8 else "int8+ConvRot"
        assert plan.formats.get(kind) == 3 * (5 + 3) + (4 + 3) + 1, plan.formats  # lm_head; MTP float
        if fp8:
            assert plan.norm_rotation == {}
        else:
            assert set(plan.norm_rotation.values()) == {group} and len(plan.norm_rotation) == 2 * 4, \
                plan.norm_rotation
        for m in model.modules():
            if getattr(m, "quant_format", None) in ("int8_tensorwise", fmt):
                m._full_precision_mm = True  # the module path: ComfyUI dequantizes, then a float matmul
    emb = torch.randn(11, d["hidden_size"], generator=rng)
    rotations, rotate = [], convrot_triton.hadamard_rotate
    if wide:  # counted in the fused MTP-off generation below
        for mod in (gemv, deltanet_step, convrot_triton):
            monkeypatch.setattr(mod, "hadamard_rotate", lambda x, h: rotations.append(1) or rotate(x, h))
    for mtp in ("off", 3):
        kw = dict(do_sample=False, max_length=6 if wide else 8, mtp=mtp, stop_tokens=[],
                  execution_dtype=torch.float32, attention="torch", cuda_graphs=False)
        rotations.clear()
        fused = generate(model, emb, **BIND, fused=True, **kw)
        if wide and mtp == "off":
            # the producers' rotated outputs are used (the DeltaNet step's too): rotation launches only
            # for lm_head's input, per decode step and once more for the prompt's last row
            assert len(rotations) == (len(fused.tokens) - 1) + 1, len(rotations)
        assert fused.tokens == generate(model, emb, **BIND, fused=False, **kw).tokens, mtp
