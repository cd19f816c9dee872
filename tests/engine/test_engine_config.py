"""Qwen35Config: inference from tensor shapes for the released sizes and tiny ones, clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from qwen35_fast.engine import Qwen35Config, Qwen35Error

from tests.oracles.tiny import to_layout

# Released sizes, written out by hand from the model cards / ComfyUI's size table.
RELEASED = {
    "0.8B": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, lm_head=False),
    "2B": dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
               num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, lm_head=False),
    "4B": dict(vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32, lm_head=False),
    "9B": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32, lm_head=True),
    "27B": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48, lm_head=True),
}


def _released(name: str) -> Qwen35Config:
    v = dict(RELEASED[name])
    n = v["num_hidden_layers"]
    return Qwen35Config(head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                        conv_kernel_size=4, stop_tokens=(248044, 248046),
                        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                          for i in range(n)), **v)


@pytest.mark.parametrize("name", sorted(RELEASED))
@pytest.mark.parametrize("layout", ["hf", "comfyui", "bare"])
def test_released_sizes_round_trip(name, layout):
    cfg = _released(name)
    shapes = cfg.text_shapes()
    if layout != "bare":
        shapes = to_layout(shapes, layout)
        shapes["model.visual.blocks.0.attn.qkv.weight" if layout == "hf" else "visual.merger.weight"] = (3, 3)
    got = Qwen35Config.from_state_dict(shapes)
    assert got == cfg
    assert got.size_name == name


def test_9b_facts():
    cfg = Qwen35Config.from_state_dict(_released("9B").text_shapes())
    assert cfg.full_attention_layers == tuple(range(3, 32, 4))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (16, 4, 256, 64)
    assert (cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim) == (32, 16, 128)
    assert cfg.lm_head and cfg.stop_tokens == (248044, 248046)
    # fp32 DeltaNet state of the 9B: 24 layers x 32 heads x 128 x 128 x 4 bytes = 48 MiB
    state = len(cfg.linear_attention_layers) * cfg.linear_num_value_heads * 128 * 128 * 4
    assert state == 48 * 2**20


def test_mtp_layers_counted():
    cfg = _released("9B")
    shapes = {**cfg.text_shapes(), **cfg.mtp_shapes()}
    assert Qwen35Config.from_state_dict(shapes).mtp_num_hidden_layers == 1
    assert Qwen35Config.from_state_dict(cfg.text_shapes()).mtp_num_hidden_layers == 0


def test_tiny_sizes_and_overrides():
    cfg = _released("2B")
    tiny = cfg.replace(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       layer_types=cfg.layer_types[:8], stop_tokens=())
    assert Qwen35Config.from_state_dict(tiny.text_shapes()) == tiny
    # the key head size is not visible in shapes: an override can set it
    odd = tiny.replace(linear_num_key_heads=1, linear_key_head_dim=32)
    assert Qwen35Config.from_state_dict(odd.text_shapes(), linear_key_head_dim=32) == odd


def test_from_comfyui_config_object():
    cfg = _released("9B")
    # ComfyUI's Qwen35Config carries the same field names (lists instead of tuples, no MTP fields).
    comfy = SimpleNamespace(**{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()
                               if k not in ("mtp_num_hidden_layers", "mrope_interleaved")},
                            transformer_type="qwen35_9b", rms_norm_add=True)
    assert Qwen35Config.from_object(comfy) == cfg
    with pytest.raises(Qwen35Error, match="hidden_size"):
        Qwen35Config.from_object(SimpleNamespace(vocab_size=3))


def test_not_qwen35_errors():
    cfg = _released("2B")
    shapes = cfg.text_shapes()
    llama = {k: v for k, v in shapes.items() if ".linear_attn." not in k}
    for i in cfg.linear_attention_layers:  # turn every layer into plain attention
        llama.update({f"layers.{i}.{n}": s for n, s in cfg.layer_shapes("full_attention").items()})
    with pytest.raises(Qwen35Error, match="Gated DeltaNet"):
        Qwen35Config.from_state_dict(llama)
    with pytest.raises(Qwen35Error, match="embed_tokens"):
        Qwen35Config.from_state_dict({k: v for k, v in shapes.items() if k != "embed_tokens.weight"})
    gap = {k: v for k, v in shapes.items() if not k.startswith("layers.5.")}
    with pytest.raises(Qwen35Error, match=r"layers \[5\]"):
        Qwen35Config.from_state_dict(gap)
    bare = {k: v for k, v in shapes.items() if k != "layers.4.linear_attn.A_log"}
    with pytest.raises(Qwen35Error, match="layer 4"):
        Qwen35Config.from_state_dict(bare)
    with pytest.raises(Qwen35Error, match="same weight in two layouts"):
        Qwen35Config.from_state_dict({**to_layout(shapes, "hf"), "model.norm.weight": (2048,)})
