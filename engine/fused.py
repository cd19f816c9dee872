"""Fused decode/verify rows: the per-layer small ops of a Qwen3.5 step as a few Triton launches.

For S <= 8 rows (decode, MTP draft and verify) a layer runs as: residual add + RMSNorm (one
kernel), the layer's own projections (its Linear modules, so quantized or patched Linears keep
working), one fused kernel for the rest of the mixer (DeltaNet: conv, norms, gates, recurrence
and gated norm; attention: q/k RMSNorm + RoPE, the length-aware decode kernel, the sigmoid gate),
residual add + RMSNorm, and the MLP with a fused SiLU-multiply. The torch path in ``forward.py``
computes the same function (prefill always uses it).

``FusedPlan.build`` reads the norm weights once (as each norm module would apply them) and says
why fusion is impossible when a module is not the plain Qwen3.5 kind (ComfyUI casting weights per
call, an unknown norm class, weights off the device, no usable Triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import triton_device_reason, triton_module

_NORM_CLASSES = ("RMSNorm",)
_GATED_CLASSES = ("RMSNormGated",)


def _triton_ops():
    """(fused_ops, deltanet_step) modules, or the reason they cannot be imported."""
    fused_ops, why = triton_module("fused_ops")
    deltanet_step, why_step = triton_module("deltanet_step")
    if why or why_step:
        return None, why or why_step
    return (fused_ops, deltanet_step), None


class _Reject(Exception):
    pass


def _resident(mod, name: str, device: torch.device) -> None:
    """Reject a module whose weight ComfyUI casts or patches per call, or that lives off ``device``."""
    if getattr(mod, "comfy_cast_weights", False) or getattr(mod, "weight_function", None):
        raise _Reject(f"ComfyUI casts or patches the weights of {name} per call")
    if mod.weight.device != device:
        raise _Reject(f"weight of {name} lives on {mod.weight.device}, not {device}")


def _norm_weight(mod, dtype: torch.dtype, device: torch.device, comfy: bool, name: str) -> tuple[torch.Tensor, float]:
    """The effective float32 weight ``[dim]`` and eps of a (1 + w) / w RMSNorm module."""
    cls = type(mod).__name__
    if cls not in _NORM_CLASSES + _GATED_CLASSES:
        raise _Reject(f"{name} is a {cls}, not a Qwen3.5 RMSNorm")
    w, eps, add = getattr(mod, "weight", None), getattr(mod, "eps", None), getattr(mod, "add", None)
    if not isinstance(w, torch.Tensor) or not isinstance(eps, float) or not isinstance(add, bool):
        raise _Reject(f"{name} ({cls}) lacks a weight tensor, a float eps or the add flag")
    _resident(mod, name, device)
    w = w.detach()
    if comfy:  # llama.RMSNorm: (w + 1) in the weight's dtype, cast to the input's dtype
        eff = (w + 1.0 if add else w).to(dtype).float()
    else:  # engine.modules.RMSNorm: float32 (w + 1)
        eff = w.float() + 1.0 if add else w.float()
    return eff.contiguous(), eps


def _mlp_parts(mlp, name: str):
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None for p in parts):
        raise _Reject(f"{name} has no gate_proj/up_proj/down_proj")
    act = getattr(mlp, "activation", F.silu)
    if act is not F.silu:
        raise _Reject(f"{name} does not use SiLU")
    return parts


class FusedPlan:
    """Prepared constants of the fused path: per layer the input/post norm weights, and for DeltaNet
    layers the conv weight ``[C,K]`` and gated-norm weight; for attention layers the q/k norm
    weights; the same for the MTP head."""

    def __init__(self, ops, norms: dict, convs: dict, mlps: dict, eps: float):
        self.ops, self.step = ops
        self.norms, self.convs, self.mlps, self.eps = norms, convs, mlps, eps

    @classmethod
    def build(cls, binding, device, dtype: torch.dtype) -> tuple[FusedPlan | None, str | None]:
        """``(plan, None)``, or ``(None, reason)`` when the fused path cannot run for this model."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if triton_device_reason(device) is not None:
            return None, f"the fused kernels need a CUDA device (running on {device.type})"
        ops, why = _triton_ops()
        if ops is None:
            return None, why
        cfg = binding.config
        probe = torch.empty(1, 1, cfg.conv_dim, dtype=dtype, device=device)
        why = ops[1].step_reason(probe, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        if why is not None:
            return None, f"the fused DeltaNet kernel does not support this model: {why}"
        comfy = binding.is_comfy
        norms, convs, mlps, eps = {}, {}, {}, set()

        def norm(mod, key):
            w, e = _norm_weight(mod, dtype, device, comfy, key)
            norms[key] = w
            eps.add(e)

        try:
            for i, layer in enumerate(binding.layers):
                norm(layer.input_layernorm, f"layers.{i}.input_layernorm")
                norm(layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
                mlps[i] = _mlp_parts(layer.mlp, f"layers.{i}.mlp")
                if cfg.layer_types[i] == "linear_attention":
                    la = layer.linear_attn
                    norm(la.norm, f"layers.{i}.linear_attn.norm")
                    conv, name = la.conv1d, f"layers.{i}.linear_attn.conv1d"
                    _resident(conv, name, device)
                    if getattr(conv, "bias", None) is not None:
                        raise _Reject(f"{name} has a bias")
                    convs[i] = conv.weight.detach().reshape(conv.weight.shape[0], -1).to(dtype).contiguous()
                else:
                    norm(layer.self_attn.q_norm, f"layers.{i}.self_attn.q_norm")
                    norm(layer.self_attn.k_norm, f"layers.{i}.self_attn.k_norm")
            norm(binding.transformer.norm, "norm")
            head = binding.mtp
            if head is not None:
                layer = head.layers[0]
                for key in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                    norm(getattr(head, key), f"mtp.{key}")
                norm(layer.input_layernorm, "mtp.layers.0.input_layernorm")
                norm(layer.post_attention_layernorm, "mtp.layers.0.post_attention_layernorm")
                norm(layer.self_attn.q_norm, "mtp.layers.0.self_attn.q_norm")
                norm(layer.self_attn.k_norm, "mtp.layers.0.self_attn.k_norm")
                mlps["mtp"] = _mlp_parts(layer.mlp, "mtp.layers.0.mlp")
        except _Reject as exc:
            return None, str(exc)
        if len(eps) != 1:
            return None, f"the norms use different eps values {sorted(eps)}"
        return cls(ops, norms, convs, mlps, eps.pop()), None

    # ------------------------------------------------------------------ building blocks
    def norm(self, key: str, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``(rms_norm(x + residual), x + residual)`` with the weight of norm ``key``. x ``[B,S,H]``."""
        return self.ops.add_rms_norm(x, residual, self.norms[key], self.eps)

    def mlp(self, key, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU through the module's own Linears: x ``[B,S,H]`` -> ``[B,S,H]``."""
        gate, up, down = self.mlps[key]
        return down(self.ops.silu_mul(gate(x), up(x)))

    def qk(self, prefix: str, attn, xn: torch.Tensor, cos, sin, head_dim: int, hq: int, hkv: int):
        """q ``[B,Hq,S,D]``, k ``[B,Hkv,S,D]`` (normed, rotated), v ``[B,Hkv,S,D]`` view, gate ``[B,S,Hq,D]`` view."""
        b, s, _ = xn.shape
        qg = attn.q_proj(xn).view(b, s, hq, 2 * head_dim)
        k = attn.k_proj(xn).view(b, s, hkv, head_dim)
        v = attn.v_proj(xn).view(b, s, hkv, head_dim).transpose(1, 2)
        q = self.ops.rms_norm_rope(qg[..., :head_dim], self.norms[f"{prefix}.q_norm"], self.eps, cos, sin)
        k = self.ops.rms_norm_rope(k, self.norms[f"{prefix}.k_norm"], self.eps, cos, sin)
        return q, k, v, qg[..., head_dim:]

    def gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o ``[B,Hq,S,D]`` * sigmoid(gate ``[B,S,Hq,D]``) -> ``[B,S,Hq*D]``."""
        return self.ops.sigmoid_gate(o, gate)

    def deltanet(self, i: int, la, xn: torch.Tensor, state, neg_a, dt_bias, key_heads: int,
                 states_out: torch.Tensor, window_out: torch.Tensor) -> torch.Tensor:
        """Fused DeltaNet mixer for S rows; writes per-row states / the conv window into the given
        buffers (the caller stages them). xn ``[B,S,H]`` -> ``[B,S,H]``."""
        out, _, _ = self.step.gated_delta_step(
            la.in_proj_qkv(xn), la.in_proj_z(xn), la.in_proj_a(xn), la.in_proj_b(xn), state.conv, self.convs[i],
            neg_a, dt_bias, state.recurrent, self.norms[f"layers.{i}.linear_attn.norm"], self.eps,
            key_heads=key_heads, states_out=states_out, window_out=window_out)
        return la.out_proj(out)
