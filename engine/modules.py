"""Standalone Qwen3.5 module tree whose attribute names mirror ComfyUI's ``Qwen35`` tree.

These modules hold weights; the math of a forward pass lives in ``forward.py`` and calls them
exactly as it calls ComfyUI's modules: ``Linear``/``Conv1d``/``Embedding`` by ``module(x)``,
``RMSNorm`` as ``(1 + w)`` (ComfyUI's ``add=True``), the DeltaNet output norm as ``norm(x, gate)``
with a plain ``w``. Like ComfyUI's manual-cast ops, every layer casts its weight to the input's
dtype and device when they differ, so a bf16 checkpoint can run in float32 and vice versa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config


def _cast(w: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if w is None or (w.dtype == x.dtype and w.device == x.device):
        return w
    return w.to(device=x.device, dtype=x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` that computes in the input's dtype. x ``[..., in]`` -> ``[..., out]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _cast(self.weight, x), _cast(self.bias, x))


class Int8Linear(nn.Module):
    """A bias-free Linear held as int8 rows: ``weight`` int8 ``[out, in]``, ``row_scale`` float32
    ``[out]``; ``y = (x @ weight.T) * row_scale`` in x's dtype (the int8 values are exact in bf16 /
    fp16, the scale is applied in float32). The fused path reads the same storage
    (``plain_weights.int8_linear_record``: the int8 weight-only GEMV)."""

    def __init__(self, weight: torch.Tensor, row_scale: torch.Tensor):
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2 or row_scale.shape != weight.shape[:1] \
                or row_scale.dtype != torch.float32:
            raise ValueError(f"Int8Linear: int8 [out, in] rows and a float32 [out] scale, got {weight.dtype} "
                             f"{tuple(weight.shape)} and {row_scale.dtype} {tuple(row_scale.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.row_scale = nn.Parameter(row_scale, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """``linear`` (no bias) rounded to int8 rows, one scale per row (its largest magnitude / 127,
        round half to even), on its device."""
        w = linear.weight.detach().float()
        scale = w.abs().amax(1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(device=x.device, dtype=x.dtype))
        return (y.float() * self.row_scale.to(x.device)).to(x.dtype)


def int8_head(head: nn.Module) -> int:
    """Replace every bias-free ``Linear`` inside ``head`` (an MTP head) by its ``Int8Linear``, in place;
    return the bytes saved."""
    saved = 0
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                q = Int8Linear.from_linear(child)
                saved += child.weight.numel() * child.weight.element_size() - q.weight.numel() - 4 * q.out_features
                setattr(parent, name, q)
    return saved


class Embedding(nn.Embedding):
    """``nn.Embedding``; ids int64 ``[...]`` -> ``[..., H]`` in the weight's dtype (or ``out_dtype``)."""

    def forward(self, ids: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = F.embedding(ids.to(self.weight.device), self.weight)
        return out if out_dtype is None else out.to(out_dtype)


class Conv1d(nn.Conv1d):
    """Depthwise causal ``nn.Conv1d`` that computes in the input's dtype. ``[B,C,T]`` -> ``[B,C,T+K-1]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, _cast(self.weight, x), _cast(self.bias, x))


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``add=True`` scales by ``(1 + w)`` (Qwen3.5), else by ``w``.

    Computed in float32, returned in the input's dtype. x ``[..., dim]`` -> same shape.
    """

    def __init__(self, dim: int, eps: float = 1e-6, add: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.add = add
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(device=x.device, dtype=torch.float32)
        if self.add:
            w = w + 1.0
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)


class RMSNormGated(RMSNorm):
    """DeltaNet output norm: ``rms_norm(x) * w * silu(gate)`` (plain ``w``). x, gate ``[..., dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__(dim, eps, add=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x).float() * F.silu(gate.float())).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int, device=None, dtype=None):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False, device=device, dtype=dtype)
        self.up_proj = Linear(hidden, inter, bias=False, device=device, dtype=dtype)
        self.down_proj = Linear(inter, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedAttention(nn.Module):
    """Weights of a full-attention layer (``q_proj`` emits ``[query_h | gate_h]`` per head)."""

    def __init__(self, cfg: Qwen35Config, device=None, dtype=None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = Linear(h, 2 * hq * d, bias=False, device=device, dtype=dtype)
        self.k_proj = Linear(h, hkv * d, bias=False, device=device, dtype=dtype)
        self.v_proj = Linear(h, hkv * d, bias=False, device=device, dtype=dtype)
        self.o_proj = Linear(hq * d, h, bias=False, device=device, dtype=dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, add=True, device=device, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, add=True, device=device, dtype=dtype)


class GatedDeltaNet(nn.Module):
    """Weights of a Gated DeltaNet layer."""

    def __init__(self, cfg: Qwen35Config, device=None, dtype=None):
        super().__init__()
        h, hv = cfg.hidden_size, cfg.linear_num_value_heads
        self.in_proj_qkv = Linear(h, cfg.conv_dim, bias=False, device=device, dtype=dtype)
        self.in_proj_z = Linear(h, cfg.value_dim, bias=False, device=device, dtype=dtype)
        self.in_proj_b = Linear(h, hv, bias=False, device=device, dtype=dtype)
        self.in_proj_a = Linear(h, hv, bias=False, device=device, dtype=dtype)
        self.conv1d = Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel_size, groups=cfg.conv_dim,
                             padding=cfg.conv_kernel_size - 1, bias=False, device=device, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(hv, device=device, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(hv, device=device, dtype=dtype))
        self.norm = RMSNormGated(cfg.linear_value_head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.out_proj = Linear(cfg.value_dim, h, bias=False, device=device, dtype=dtype)


class DecoderLayer(nn.Module):
    """One decoder layer: ``linear_attn`` or ``self_attn``, then the MLP, each behind an RMSNorm."""

    def __init__(self, cfg: Qwen35Config, layer_type: str, device=None, dtype=None):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, device=device, dtype=dtype)
        else:
            self.self_attn = GatedAttention(cfg, device=device, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)


class MTPHead(nn.Module):
    """Multi-token-prediction head: ``fc``, two pre-fc norms, one full-attention layer, ``norm``."""

    def __init__(self, cfg: Qwen35Config, num_layers: int = 1, device=None, dtype=None):
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False, device=device, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, "full_attention", device=device, dtype=dtype) for _ in range(num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, device=device, dtype=dtype)


class Qwen35TextModel(nn.Module):
    """The decoder (ComfyUI's ``Qwen35Transformer``): ``embed_tokens``, ``layers``, ``norm``,
    ``lm_head`` for untied sizes, ``mtp`` when an MTP head is attached, and ``config``."""

    def __init__(self, cfg: Qwen35Config, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, device=device, dtype=dtype) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        if cfg.lm_head:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        self.mtp: MTPHead | None = None


class Qwen35ForGeneration(nn.Module):
    """Root of the standalone tree (ComfyUI's ``Qwen35`` BaseGenerate instance): ``.model`` is the
    decoder; ``.mtp`` reads and sets ``.model.mtp`` (where ``bind`` looks for the head)."""

    def __init__(self, model: Qwen35TextModel):
        super().__init__()
        self.model = model

    def __setattr__(self, name, value):
        if name == "mtp":
            self.model.mtp = value
        else:
            super().__setattr__(name, value)

    @property
    def config(self) -> Qwen35Config:
        return self.model.config

    @property
    def mtp(self) -> MTPHead | None:
        return self.model.mtp
