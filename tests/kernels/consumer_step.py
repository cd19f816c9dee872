"""The 9B decode step's kernel launches, compiled for a GPU this machine does not have.

Run as a script (``tests/kernels/test_consumer_gpu.py`` does): ``python tests/kernels/consumer_step.py SPEC`` with
SPEC a JSON object ``{"cc": 89, "shared": 101376, "cells": [["bfloat16", "int8"], ...], "rows": [1, 4]}``.
It installs ``tests/kernels/fake_gpu.py``'s driver for that GPU, imports the pack without the interpreter,
and calls each kernel entry point the fused decode step calls (``engine/fused.py``: the norms, the
grouped GEMVs with their picked launch configs and split-K, the DeltaNet step, q/k norm + RoPE
into the KV cache, decode attention, the gates, the RoPE tables, ``lm_head``, the argmax, and the
MTP head's ``fc``) at Qwen3.5-9B's shapes, for each cell (activation dtype, weight format: int8 with
ConvRot 256 as the Comfy-Org PE file, fp8 e4m3fn per tensor, or weights in the activation dtype)
and each row count. Every launch goes through Triton's compile for that target and its shared
memory check; none runs. Prints one JSON object: the Triton version, why launches do not overlap
(null where they do: programmatic dependent launch), per call, the error (or null), the launches
(kernel, shared bytes, warps, stages, grid), the warnings the pack logged and, for a GEMV, the
launch config the pack picked; then a last call per cell whose explicit config (never shrunk)
needs more shared memory than any GPU has: it must fail, or the check is not live.

The pack's own checks see CPU tensors, so one device record stands in for the GPU:
``capabilities.simulate`` (CPU tensors go to Triton compiled for it; launch picks read its SM count
and shared memory, ``kernels/launch.py``: the same-architecture table, else the computed fallback;
for compute capability 9.0+, launches use programmatic dependent launch where this Triton has it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

H, INTER, VOCAB = 4096, 12288, 248320  # Qwen3.5-9B
HK, HV, DK, DV, CONV = 16, 32, 128, 128, 4  # DeltaNet heads
HQ, HKV, HEAD = 16, 4, 256  # attention heads
GROUP = 256  # ConvRot group of the Comfy-Org int8 file
EPS = 1e-6


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(spec: dict) -> dict:
    os.environ.pop("TRITON_INTERPRET", None)
    fake_gpu = _load("fake_gpu", HERE / "fake_gpu.py")
    gpu = fake_gpu.install(spec["cc"], spec["shared"])
    import torch

    sys.path.insert(0, str(ROOT))
    from _standalone import load_pack

    load_pack()
    from qwen35_fast.kernels import (
        argmax,
        attention_triton,
        capabilities,
        convrot_triton,
        deltanet_step,
        fused_ops,
        gemv,
        launch,
    )

    capabilities.simulate(capabilities.DeviceRecord(f"simulated sm_{spec['cc']}", spec["cc"], gpu.sms, gpu.shared,
                                                    64 << 20))
    warned = _load("log_messages", ROOT / "tests" / "oracles" / "log_messages.py").Messages(logging.WARNING)
    logging.getLogger("qwen35_fast").addHandler(warned)
    logging.getLogger("qwen35_fast").setLevel(logging.WARNING)
    calls = []

    def call(name: str, fn, picked=None):
        n0, w0 = len(gpu.launched), len(warned.messages)
        error = None
        try:
            fn()
        except Exception as exc:  # reported, the test decides
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        calls.append({"call": name, "error": error, "warnings": warned.messages[w0:], "picked": picked,
                      "launches": [vars(x) for x in gpu.launched[n0:]]})

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    for dt_name, fmt in spec["cells"]:
        dt = dtypes[dt_name]
        for rows in spec["rows"]:
            _step(call, torch, gemv, launch, fused_ops, deltanet_step, attention_triton, argmax, convrot_triton, dt,
                  fmt, rows, f"{dt_name} {fmt} rows {rows}")
    pdl_off = capabilities.triton_pdl_reason() if spec["cc"] >= 90 else "compute capability below 9.0"
    return {"triton": __import__("triton").__version__, "pdl": pdl_off, "warnings": warned.messages, "calls": calls}


FOUR_BIT = {"w4a4": "convrot_w4a4", "nvfp4": "nvfp4"}


def _packed(torch, fmt: str, shapes):
    """4-bit weights (``kernels/packed4.py``) of one launch's group, uninitialized (never read)."""
    from qwen35_fast.kernels.packed4 import Packed4, round_up

    if fmt == "w4a4":
        return [Packed4("convrot_w4a4", torch.empty(n, k // 2, dtype=torch.int8), torch.ones(n), None, n, k, GROUP)
                for n, k in shapes]
    return [Packed4("nvfp4", torch.empty(round_up(n, 16), k // 2, dtype=torch.uint8), torch.ones(()),
                    torch.empty(round_up(n, 128), round_up(k // 16, 4), dtype=torch.float8_e4m3fn), n, k)
            for n, k in shapes]


def _weights(torch, fmt: str, dt, shapes):
    """(weights, scales or None) of one launch's group, uninitialized (never read)."""
    if fmt == "int8":
        return [torch.empty(s, dtype=torch.int8) for s in shapes], [torch.ones(s[0]) for s in shapes]
    if fmt == "fp8":
        return [torch.empty(s, dtype=torch.float8_e4m3fn) for s in shapes], [torch.ones(()) for _ in shapes]
    return [torch.empty(s, dtype=dt) for s in shapes], None


def _step(call, torch, gemv, launch, fused_ops, deltanet_step, attention_triton, argmax, convrot_triton, dt, fmt,
          rows, tag):
    quant = fmt != "float"
    group = GROUP if fmt in ("int8", "w4a4") else 0  # ConvRot: the activations arrive rotated
    x = torch.zeros(1, rows, H, dtype=dt)
    partials = torch.zeros(launch.split_k(H, H, quant, rows, x.device), 1, rows, H)  # an output projection's split-K
    norm_w = torch.ones(H)

    def lin(name, src, shapes, *, split=1, row_norm=None, prefetch=None, config=None, weights=fmt):
        if weights in FOUR_BIT:  # the 4-bit GEMV (``kernels/gemv4.py``), rotated rows in for w4a4
            from qwen35_fast.kernels import gemv4

            ps = _packed(torch, fmt, shapes)
            picked = config or launch.gemv4(sum(s[0] for s in shapes), shapes[0][1], FOUR_BIT[fmt],
                                            src.numel() // src.shape[-1], src.device, weights=len(shapes),
                                            x_bytes=src.element_size())[0]
            call(f"{tag}: {name}", lambda: gemv4.gemv4_group(src, ps, rotate=False, split=split, row_norm=row_norm,
                                                             prefetch=prefetch, config=config), picked=list(picked))
            return
        ws, ss = _weights(torch, weights, dt, shapes)
        call(f"{tag}: {name}", lambda: gemv.gemv_group(src, ws, scales=ss, split=split, row_norm=row_norm,
                                                       prefetch=prefetch, config=config),
             picked=list(config or gemv._picked(sum(s[0] for s in shapes), shapes[0][1], quant,
                                                src.numel() // src.shape[-1], src, len(shapes))))

    def norm(name, residual, defer):
        out = []
        call(f"{tag}: {name}", lambda: out.append(fused_ops.add_rms_norm(x, residual, norm_w, EPS, rotate=group,
                                                                          defer=defer)))
        return out[0] if out else None

    # a DeltaNet layer: input norm (deferred into the four inputs), step, out_proj split over K
    normed = norm("input norm (deferred)", partials, True)
    row_norm = normed[-1] if normed else None
    lin("DeltaNet inputs", x, [(2 * HK * DK + HV * DV, H), (HV * DV, H), (HV, H), (HV, H)], row_norm=row_norm)
    if fmt in FOUR_BIT and dt != torch.float32:  # the tensor-core register tile (``gemv4m.py``), both step widths
        for cfg in ((16, 128, 4, 1, 2), (16, 256, 8, 1, 2)):
            lin(f"DeltaNet inputs, register tile {cfg}", x, [(2 * HK * DK + HV * DV, H), (HV * DV, H), (HV, H),
                                                             (HV, H)], row_norm=row_norm, config=cfg)
    c = 2 * HK * DK + HV * DV
    call(f"{tag}: DeltaNet step", lambda: deltanet_step.gated_delta_step(
        torch.zeros(1, rows, c, dtype=dt), torch.zeros(1, rows, HV * DV, dtype=dt), torch.zeros(1, rows, HV, dtype=dt),
        torch.zeros(1, rows, HV, dtype=dt), torch.zeros(1, c, CONV - 1, dtype=dt), torch.zeros(c, CONV, dtype=dt),
        -torch.ones(HV), torch.zeros(HV), torch.zeros(1, HV, DK, DV), torch.ones(DV), EPS, key_heads=HK,
        rotate=group, last_in_place=True))
    lin("DeltaNet out_proj (split K)", x, [(H, H)], split=launch.split_k(H, H, quant, rows, x.device))
    # the MLP: post-attention norm, gate/up, SiLU product, down split over K
    normed = norm("post-attention norm (deferred)", partials, True)
    lin("gate/up", x, [(INTER, H), (INTER, H)], row_norm=normed[-1] if normed else None)
    g = torch.zeros(1, rows, INTER, dtype=dt)
    call(f"{tag}: SiLU product", lambda: fused_ops.silu_mul(g, g, rotate=group))
    lin("MLP down (split K)", torch.zeros(1, rows, INTER, dtype=dt), [(H, INTER)],
        split=launch.split_k(H, INTER, quant, rows, x.device))
    # an attention layer: q (with its gate) / k / v, q/k norm + RoPE into the cache, attention, o_proj
    norm("input norm (not deferred)", partials, False)
    lin("q/k/v", x, [(2 * HQ * HEAD, H), (HKV * HEAD, H), (HKV * HEAD, H)])
    cap = 4096
    k_cache = torch.zeros(1, HKV, cap, HEAD, dtype=dt)
    v_cache = torch.zeros(1, HKV, cap, HEAD, dtype=dt)
    length = torch.tensor([100], dtype=torch.int32)
    cos, sin = torch.zeros(rows, 64), torch.zeros(rows, 64)
    call(f"{tag}: q/k norm + RoPE into the cache", lambda: fused_ops.rms_norm_rope_qk(
        torch.zeros(1, rows, HQ, HEAD, dtype=dt), torch.zeros(1, rows, HKV, HEAD, dtype=dt),
        torch.zeros(1, rows, HKV, HEAD, dtype=dt), torch.ones(HEAD), torch.ones(HEAD), EPS, cos, sin,
        k_cache, v_cache, length))
    q = torch.zeros(1, HQ, rows, HEAD, dtype=dt)
    gate = torch.zeros(1, rows, HQ, HEAD, dtype=dt)
    if group:  # an int8 ConvRot o_proj: attend, then the gate kernel rotates
        call(f"{tag}: decode attention", lambda: attention_triton.triton_decode_attention(
            q, k_cache, v_cache, length, True, HEAD ** -0.5, pending=rows))
        call(f"{tag}: output gate", lambda: fused_ops.sigmoid_gate(q, gate, rotate=group))
    else:
        call(f"{tag}: decode attention + gate", lambda: attention_triton.triton_decode_attention_gated(
            q, k_cache, v_cache, length, True, HEAD ** -0.5, gate, pending=rows))
    lin("o_proj (split K)", torch.zeros(1, rows, HQ * HEAD, dtype=dt), [(H, HQ * HEAD)],
        split=launch.split_k(H, HQ * HEAD, quant, rows, x.device))
    # the step's ends: RoPE tables, final norm, lm_head (prefetching the next step's first weight), argmax
    call(f"{tag}: RoPE tables", lambda: fused_ops.rope_tables(torch.zeros(3, rows, dtype=torch.int64),
                                                              torch.ones(32), torch.zeros(64, dtype=torch.int64)))
    norm("final norm (not deferred)", partials, False)
    lin("lm_head", x, [(VOCAB, H)], prefetch=torch.zeros(HV * DV, H, dtype=torch.int8))
    call(f"{tag}: argmax", lambda: argmax.argmax_rows(torch.zeros(rows, VOCAB, dtype=dt)))
    lin("MTP fc", torch.zeros(1, rows, 2 * H, dtype=dt), [(H, 2 * H)])
    if group:
        call(f"{tag}: ConvRot rotation launch", lambda: convrot_triton.hadamard_rotate(
            x, convrot_triton.hadamard_cached(GROUP, x.device, dt)))
    # the check itself: an explicit launch config is never shrunk, so one past the limit must fail
    # (with int8 weights for a 4-bit step: its tiles stream through registers, not shared memory)
    lin("explicit config past the limit", x, [(INTER, H)], config=(256, 256, 4, 8),
        weights="int8" if fmt in FOUR_BIT else fmt)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
