"""Tiny random Qwen3.5 checkpoints for tests (canonical tensor names, float32).

Weights are random, including every norm weight, A_log and dt_bias. ``strength`` scales the
layers' output projections: small values keep the residual stream close to the token embedding,
so the model behaves like a noisy bigram model and an MTP head built by ``add_mtp`` (fc selecting
the embedding half, layer copied from a full-attention layer) drafts tokens that are often, but
not always, accepted.
"""

from __future__ import annotations

import torch


def tiny_dims(**overrides) -> dict:
    """Dimensions of a tiny model (head_dim 64 so the decode-attention kernels apply)."""
    dims = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, conv_kernel_size=4,
                tied=False)
    dims.update(overrides)
    return dims


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def _w(g, *shape, scale=1.0):
    fan_in = shape[-1]
    return torch.randn(*shape, generator=g) * (scale / fan_in ** 0.5)


def _norm(g, dim, spread=0.3):
    return torch.randn(dim, generator=g) * spread


def _layer(g, d, kind: str, strength: float) -> dict[str, torch.Tensor]:
    h, inter = d["hidden_size"], d["intermediate_size"]
    out = {
        "input_layernorm.weight": _norm(g, h),
        "post_attention_layernorm.weight": _norm(g, h),
        "mlp.gate_proj.weight": _w(g, inter, h),
        "mlp.up_proj.weight": _w(g, inter, h),
        "mlp.down_proj.weight": _w(g, h, inter, scale=strength),
    }
    if kind == "linear_attention":
        hk, hv = d["linear_num_key_heads"], d["linear_num_value_heads"]
        dk, dv = d["linear_key_head_dim"], d["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        out.update({
            "linear_attn.in_proj_qkv.weight": _w(g, conv, h),
            "linear_attn.in_proj_z.weight": _w(g, hv * dv, h),
            "linear_attn.in_proj_b.weight": _w(g, hv, h),
            "linear_attn.in_proj_a.weight": _w(g, hv, h),
            "linear_attn.conv1d.weight": torch.randn(conv, 1, d["conv_kernel_size"], generator=g) * 0.5,
            "linear_attn.dt_bias": torch.randn(hv, generator=g),
            "linear_attn.A_log": torch.rand(hv, generator=g) * 2.0 - 1.0,
            "linear_attn.norm.weight": 1.0 + _norm(g, dv),
            "linear_attn.out_proj.weight": _w(g, h, hv * dv, scale=strength),
        })
    else:
        hq, hkv, hd = d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
        out.update({
            "self_attn.q_proj.weight": _w(g, 2 * hq * hd, h, scale=2.0),
            "self_attn.k_proj.weight": _w(g, hkv * hd, h, scale=2.0),
            "self_attn.v_proj.weight": _w(g, hkv * hd, h),
            "self_attn.o_proj.weight": _w(g, h, hq * hd, scale=strength),
            "self_attn.q_norm.weight": _norm(g, hd),
            "self_attn.k_norm.weight": _norm(g, hd),
        })
    return out


def make_tiny(seed: int, *, strength: float = 1.0, **overrides) -> tuple[dict[str, torch.Tensor], dict]:
    """(canonical state dict, dims) of a random tiny Qwen3.5 text decoder."""
    d = tiny_dims(**overrides)
    d["layer_types"] = layer_types(d["num_hidden_layers"])
    g = torch.Generator().manual_seed(seed)
    sd = {"embed_tokens.weight": torch.randn(d["vocab_size"], d["hidden_size"], generator=g),
          "norm.weight": _norm(g, d["hidden_size"])}
    if not d["tied"]:
        sd["lm_head.weight"] = _w(g, d["vocab_size"], d["hidden_size"], scale=4.0)
    for i, kind in enumerate(d["layer_types"]):
        for name, t in _layer(g, d, kind, strength).items():
            sd[f"layers.{i}.{name}"] = t
    return sd, d


def add_mtp(sd: dict[str, torch.Tensor], d: dict, seed: int, *, noise: float = 0.05,
            norm_spread: float = 0.1) -> dict[str, torch.Tensor]:
    """Add an MTP head (``mtp.*``) whose layer copies the first full-attention layer and whose fc
    mostly passes the embedding half through, so its drafts track the model's own bigram habit."""
    g = torch.Generator().manual_seed(seed)
    h = d["hidden_size"]
    full = d["layer_types"].index("full_attention")
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)
    fc += torch.randn(h, 2 * h, generator=g) * (noise / h ** 0.5)
    out = dict(sd)
    out.update({
        "mtp.fc.weight": fc,
        "mtp.pre_fc_norm_embedding.weight": _norm(g, h, norm_spread),
        "mtp.pre_fc_norm_hidden.weight": _norm(g, h, norm_spread),
        "mtp.norm.weight": sd["norm.weight"].clone(),
    })
    prefix = f"layers.{full}."
    for name, t in sd.items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix):]] = t.clone()
    return out


def to_layout(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Rename canonical keys to the "hf" (``model.language_model.*``) or "comfyui" (``model.*``) layout."""
    out = {}
    for name, t in sd.items():
        if name.startswith("mtp."):
            out[name] = t
        elif name == "lm_head.weight":
            out["lm_head.weight" if layout == "hf" else "model.lm_head.weight"] = t
        else:
            out[("model.language_model." if layout == "hf" else "model.") + name] = t
    return out


def save(sd: dict[str, torch.Tensor], path, layout: str = "hf") -> str:
    """Write ``sd`` (canonical names) to a safetensors file in ``layout``; returns the path."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in to_layout(sd, layout).items()}, str(path))
    return str(path)


def engine_model(sd: dict[str, torch.Tensor], directory, layout: str = "hf", **kwargs):
    """Save ``sd`` under ``directory`` and load it with the engine's standalone loader."""
    from qwen35_fast.engine import load_standalone

    path = save(sd, f"{directory}/tiny-{layout}.safetensors", layout)
    return load_standalone(path, **kwargs)
