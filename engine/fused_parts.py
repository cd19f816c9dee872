"""What a fused plan reads from a binding (``fused.FusedPlan.build``): the Triton op modules, the
norm weights as each norm module applies them, the MLP's parts, the projections of a step in launch
order, the embedding table read in place, and ``Deferred`` (a norm output whose per-row factor a
GEMV applies). ``Reject`` says why a module cannot be read in place."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels import triton_module
from ..kernels.row_norm import RowNorm, factor

_NORM_CLASSES = ("RMSNorm",)
_GATED_CLASSES = ("RMSNormGated",)


def triton_ops():
    """(fused_ops, deltanet_step) modules, or the reason they cannot be imported."""
    fused_ops, why = triton_module("fused_ops")
    deltanet_step, why_step = triton_module("deltanet_step")
    if why or why_step:
        return None, why or why_step
    return (fused_ops, deltanet_step), None



class Reject(Exception):
    pass


class Deferred(NamedTuple):
    """A norm's output whose per-row RMSNorm factor the projections reading it apply
    (``kernels/row_norm.py``): ``rows`` ``[B,S,H]`` = h * weight, ``norm`` the factor's partials,
    ``rotated`` ``(G, rows rotated)`` or None."""

    rows: torch.Tensor
    norm: RowNorm
    rotated: tuple[int, torch.Tensor] | None

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    def materialize(self) -> torch.Tensor:
        """The norm's output itself (``rows`` times the factor, rounded to rows' dtype)."""
        return (self.rows.float() * factor(self.norm)).to(self.rows.dtype)


def resident(weights, mod, name: str, device: torch.device) -> None:
    """Reject a module whose own parameters cannot be read in place (the weight hook says why)."""
    why = weights.tensor_reason(mod, device)
    if why is not None:
        raise Reject(f"{name}: {why}")


def norm_weight(weights, mod, dtype: torch.dtype, device: torch.device, name: str) -> tuple[torch.Tensor, float]:
    """The effective float32 weight ``[dim]`` and eps of a (1 + w) / w RMSNorm module."""
    cls = type(mod).__name__
    if cls not in _NORM_CLASSES + _GATED_CLASSES:
        raise Reject(f"{name} is a {cls}, not a Qwen3.5 RMSNorm")
    w, eps, add = getattr(mod, "weight", None), getattr(mod, "eps", None), getattr(mod, "add", None)
    if not isinstance(w, torch.Tensor) or not isinstance(eps, float) or not isinstance(add, bool):
        raise Reject(f"{name} ({cls}) lacks a weight tensor, a float eps or the add flag")
    resident(weights, mod, name, device)
    return weights.norm_scale(mod, dtype).to(device=device, dtype=torch.float32).contiguous(), eps


def mlp_parts(mlp, name: str):
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None for p in parts):
        raise Reject(f"{name} has no gate_proj/up_proj/down_proj")
    act = getattr(mlp, "activation", F.silu)
    if act is not F.silu:
        raise Reject(f"{name} does not use SiLU")
    return parts


def projections(binding) -> list[tuple[str, object]]:
    """Every projection a decode step runs: ``(name, module)`` in model order, the output last."""
    cfg, out = binding.config, []
    parts = {"linear_attention": ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")),
             "full_attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))}
    for i, layer in enumerate(binding.layers):
        sub, names = parts[cfg.layer_types[i]]
        out += [(f"layers.{i}.{sub}.{n}", getattr(getattr(layer, sub), n)) for n in names]
        out += [(f"layers.{i}.mlp.{n}", getattr(layer.mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    head = binding.mtp
    if head is not None:
        layer = head.layers[0]
        out.append(("mtp.fc", head.fc))
        out += [(f"mtp.layers.0.self_attn.{n}", getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj")]
        out += [(f"mtp.layers.0.mlp.{n}", getattr(layer.mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    out.append(("lm_head" if getattr(binding.transformer, "lm_head", None) is not None else "embed_tokens (tied)",
                binding.output_module))
    return [(n, m) for n, m in out if m is not None]


def embedding_table(weights, module, device: torch.device) -> torch.Tensor | None:
    """The embedding module's table ``[V, H]`` when a lookup of it equals the module's call (a plain
    float matrix on ``device``, no max_norm, no per-call work), else None (the module is called)."""
    w = getattr(module, "weight", None)
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 2 or not w.is_floating_point():
        return None
    if getattr(module, "max_norm", None) is not None or w.device != device:
        return None
    return w.detach() if weights.tensor_reason(module, device) is None else None


