"""transformers' ``Qwen3_5ForCausalLM`` built from a tiny canonical state dict (test-only oracle)."""

from __future__ import annotations

import torch


def hf_model(sd: dict[str, torch.Tensor], d: dict, *, eps: float = 1e-6, theta: float = 1e7):
    """A float32 ``Qwen3_5ForCausalLM`` in eval mode holding the weights of ``sd`` (dims ``d``)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
        linear_num_key_heads=d["linear_num_key_heads"], linear_num_value_heads=d["linear_num_value_heads"],
        linear_key_head_dim=d["linear_key_head_dim"], linear_value_head_dim=d["linear_value_head_dim"],
        linear_conv_kernel_dim=d["conv_kernel_size"], layer_types=list(d["layer_types"]), rms_norm_eps=eps,
        tie_word_embeddings=bool(d["tied"]),
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg).eval()
    state = {f"model.{k}": v for k, v in sd.items() if not k.startswith("mtp.")}
    state["lm_head.weight"] = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["embed_tokens.weight"]
    state.pop("model.lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise AssertionError(f"state dict does not fit transformers' model: missing {missing}, "
                             f"unexpected {unexpected}")
    return model.float()
