"""``Qwen35Config``: every dimension of a Qwen3.5 text decoder, inferred from tensor shapes.

Field names follow ComfyUI's ``comfy.text_encoders.qwen35.Qwen35Config`` so either object can
describe a model. Shapes alone fix everything except how the DeltaNet key width splits into
heads and head size; like every released size we take the key head size equal to the value
head size (128), which ``from_state_dict(..., linear_key_head_dim=...)`` can override.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .checkpoint_keys import canonical_map
from .errors import Qwen35Error

#: Stop tokens of the released tokenizer: ``<|endoftext|>`` and ``<|im_end|>``.
RELEASED_STOP_TOKENS = (248044, 248046)

#: Released sizes by (hidden, layers, query heads, value heads): name used in logs.
KNOWN_SIZES = {
    (1024, 24, 8, 16): "0.8B",
    (2048, 24, 8, 16): "2B",
    (2560, 32, 16, 32): "4B",
    (4096, 32, 16, 32): "9B",
    (5120, 64, 24, 48): "27B",
}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass
class Qwen35Config:
    """Dimensions of a Qwen3.5 text decoder (plus its optional MTP head).

    ``layer_types[i]`` is "linear_attention" (Gated DeltaNet) or "full_attention". ``lm_head``
    is True when the output projection is its own tensor (else tied to ``embed_tokens``).
    ``mtp_num_hidden_layers`` is 0 without an MTP head. ``mrope_interleaved`` picks the MRoPE
    frequency layout for 3-axis positions (True: Qwen3-VL/Qwen3.5 interleaved layout, as in
    transformers; False: contiguous sections, as in ComfyUI's qwen35.py); text-only positions
    give the same result either way.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel_size: int
    layer_types: tuple[str, ...]
    lm_head: bool = False
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    stop_tokens: tuple[int, ...] = field(default=())
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types)
        self.mrope_section = tuple(self.mrope_section)
        self.stop_tokens = tuple(int(t) for t in self.stop_tokens)
        if len(self.layer_types) != self.num_hidden_layers:
            raise Qwen35Error(f"Qwen35Config: {len(self.layer_types)} layer_types for "
                              f"{self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise Qwen35Error(f"Qwen35Config: unknown layer types {bad}")
        if self.linear_num_value_heads % max(1, self.linear_num_key_heads):
            raise Qwen35Error(f"Qwen35Config: DeltaNet value heads ({self.linear_num_value_heads}) must be a "
                              f"multiple of key heads ({self.linear_num_key_heads})")
        if self.num_attention_heads % max(1, self.num_key_value_heads):
            raise Qwen35Error(f"Qwen35Config: query heads ({self.num_attention_heads}) must be a multiple of "
                              f"kv heads ({self.num_key_value_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise Qwen35Error(f"Qwen35Config: rotary dim {self.rotary_dim} (head_dim {self.head_dim} x "
                              f"partial_rotary_factor {self.partial_rotary_factor}) must be even and in (0, head_dim]")

    # ------------------------------------------------------------------ derived sizes
    @property
    def rotary_dim(self) -> int:
        """Leading head dims that get RoPE (64 of 256 for the released sizes)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        """DeltaNet key width ``linear_num_key_heads * linear_key_head_dim``."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """DeltaNet value width ``linear_num_value_heads * linear_value_head_dim``."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv (q, k and v together)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def size_name(self) -> str:
        """"9B" etc. for a released size, else "custom"."""
        key = (self.hidden_size, self.num_hidden_layers, self.num_attention_heads, self.linear_num_value_heads)
        return KNOWN_SIZES.get(key, "custom")

    def replace(self, **changes) -> Qwen35Config:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ shapes
    def layer_shapes(self, layer_type: str) -> dict[str, tuple[int, ...]]:
        """Shapes of one decoder layer's tensors (names relative to ``layers.N.``)."""
        h, i = self.hidden_size, self.intermediate_size
        out = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        if layer_type == "linear_attention":
            hv = self.linear_num_value_heads
            out.update({
                "linear_attn.in_proj_qkv.weight": (self.conv_dim, h),
                "linear_attn.in_proj_z.weight": (self.value_dim, h),
                "linear_attn.in_proj_b.weight": (hv, h),
                "linear_attn.in_proj_a.weight": (hv, h),
                "linear_attn.conv1d.weight": (self.conv_dim, 1, self.conv_kernel_size),
                "linear_attn.dt_bias": (hv,),
                "linear_attn.A_log": (hv,),
                "linear_attn.norm.weight": (self.linear_value_head_dim,),
                "linear_attn.out_proj.weight": (h, self.value_dim),
            })
        else:
            d, hq, hkv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
            out.update({
                "self_attn.q_proj.weight": (2 * hq * d, h),
                "self_attn.k_proj.weight": (hkv * d, h),
                "self_attn.v_proj.weight": (hkv * d, h),
                "self_attn.o_proj.weight": (h, hq * d),
                "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,),
            })
        return out

    def text_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> shape of every text-decoder tensor (no MTP)."""
        out = {"embed_tokens.weight": (self.vocab_size, self.hidden_size), "norm.weight": (self.hidden_size,)}
        if self.lm_head:
            out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        for n, kind in enumerate(self.layer_types):
            for name, shape in self.layer_shapes(kind).items():
                out[f"layers.{n}.{name}"] = shape
        return out

    def mtp_shapes(self, num_layers: int = 1) -> dict[str, tuple[int, ...]]:
        """Canonical name (``mtp.*``) -> shape of every MTP-head tensor."""
        h = self.hidden_size
        out = {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
        for n in range(num_layers):
            for name, shape in self.layer_shapes("full_attention").items():
                out[f"mtp.layers.{n}.{name}"] = shape
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(cls, shapes_or_tensors: Mapping[str, Any], **overrides) -> Qwen35Config:
        """Infer the config from tensor shapes (values: tensors, ``torch.Size`` or tuples).

        Keys may be in the HF layout (``model.language_model.*``), the ComfyUI layout (``model.*``)
        or canonical. ``overrides`` set fields the shapes cannot tell (e.g. ``rope_theta``,
        ``stop_tokens``, ``linear_key_head_dim``). Raises Qwen35Error naming the tensor when the
        mapping is not a Qwen3.5 text decoder.
        """
        names = canonical_map(shapes_or_tensors.keys())
        shapes = {c: _shape(shapes_or_tensors[k]) for c, k in names.items()}

        def get(name: str, ndim: int) -> tuple[int, ...]:
            if name not in shapes:
                raise Qwen35Error(f"missing tensor {name!r} (HF name 'model.language_model.{name}'): "
                                  "the file is not a complete Qwen3.5 text decoder")
            shape = shapes[name]
            if len(shape) != ndim:
                raise Qwen35Error(f"tensor {names[name]!r} has shape {shape}; expected {ndim} dims")
            return shape

        if "embed_tokens.weight" not in shapes:
            raise Qwen35Error("not a Qwen3.5 checkpoint: no 'model.language_model.embed_tokens.weight' "
                              "(HF) or 'model.embed_tokens.weight' (ComfyUI) tensor")
        vocab, hidden = get("embed_tokens.weight", 2)
        idx = sorted({int(m.group(1)) for c in shapes if (m := _LAYER_RE.match(c))})
        if not idx:
            raise Qwen35Error("not a Qwen3.5 checkpoint: no 'layers.N.*' tensors")
        if idx != list(range(len(idx))):
            missing = sorted(set(range(idx[-1] + 1)) - set(idx))
            raise Qwen35Error(f"layers {missing} have no tensors (expected layers 0..{idx[-1]}); "
                              "the file is incomplete")
        types = []
        for n in idx:
            if f"layers.{n}.linear_attn.A_log" in shapes:
                types.append("linear_attention")
            elif f"layers.{n}.self_attn.q_proj.weight" in shapes:
                types.append("full_attention")
            else:
                raise Qwen35Error(f"layer {n} has neither 'linear_attn.A_log' nor 'self_attn.q_proj.weight': "
                                  "not a Qwen3.5 decoder layer")
        if "linear_attention" not in types:
            raise Qwen35Error("not a Qwen3.5 checkpoint: no Gated DeltaNet layer "
                              "('model.language_model.layers.N.linear_attn.A_log'); a plain Qwen3/Llama "
                              "model cannot run on this engine")
        if "full_attention" not in types:
            raise Qwen35Error("not a Qwen3.5 checkpoint: no full-attention layer ('layers.N.self_attn.q_proj.weight')")

        f = types.index("full_attention")
        head_dim = get(f"layers.{f}.self_attn.q_norm.weight", 1)[0]
        q_out = get(f"layers.{f}.self_attn.q_proj.weight", 2)[0]
        kv_out = get(f"layers.{f}.self_attn.k_proj.weight", 2)[0]
        if q_out % (2 * head_dim) or kv_out % head_dim:
            raise Qwen35Error(f"layers.{f}.self_attn: q_proj rows {q_out} / k_proj rows {kv_out} are not "
                              f"multiples of 2*head_dim / head_dim ({head_dim}); not Qwen3.5 gated attention")
        lin = types.index("linear_attention")
        hv = get(f"layers.{lin}.linear_attn.A_log", 1)[0]
        dv = get(f"layers.{lin}.linear_attn.norm.weight", 1)[0]
        qkv_out = get(f"layers.{lin}.linear_attn.in_proj_qkv.weight", 2)[0]
        kernel = get(f"layers.{lin}.linear_attn.conv1d.weight", 3)[-1]
        key_width2 = qkv_out - hv * dv
        dk = int(overrides.pop("linear_key_head_dim", dv))
        if key_width2 <= 0 or key_width2 % (2 * dk):
            raise Qwen35Error(f"layers.{lin}.linear_attn.in_proj_qkv has {qkv_out} rows, which does not split "
                              f"into 2 x key heads of {dk} plus {hv} value heads of {dv}")
        inter = get("layers.0.mlp.gate_proj.weight", 2)[0]
        mtp_idx = sorted({int(m.group(1)) for c in shapes if (m := _MTP_LAYER_RE.match(c))})
        has_mtp = "mtp.fc.weight" in shapes
        values = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=len(idx),
            num_attention_heads=q_out // (2 * head_dim), num_key_value_heads=kv_out // head_dim,
            head_dim=head_dim, linear_num_key_heads=key_width2 // (2 * dk), linear_num_value_heads=hv,
            linear_key_head_dim=dk, linear_value_head_dim=dv, conv_kernel_size=kernel, layer_types=tuple(types),
            lm_head="lm_head.weight" in shapes,
            stop_tokens=RELEASED_STOP_TOKENS if vocab > max(RELEASED_STOP_TOKENS) else (),
            mtp_num_hidden_layers=(len(mtp_idx) or 1) if has_mtp else 0,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_object(cls, cfg: Any, **overrides) -> Qwen35Config:
        """Copy the fields of a config object with the same attribute names (e.g. ComfyUI's)."""
        values = {}
        for f in dataclasses.fields(cls):
            if hasattr(cfg, f.name):
                values[f.name] = getattr(cfg, f.name)
        if "conv_kernel_size" not in values and hasattr(cfg, "linear_conv_kernel_dim"):
            values["conv_kernel_size"] = cfg.linear_conv_kernel_dim
        if "lm_head" in values:
            values["lm_head"] = bool(values["lm_head"])
        values.update(overrides)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in values and f.default is dataclasses.MISSING]
        if missing:
            raise Qwen35Error(f"config object {type(cfg).__name__} lacks {missing}: not a Qwen3.5 config")
        return cls(**values)


def _shape(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    try:
        return tuple(int(s) for s in shape)
    except TypeError as exc:
        raise Qwen35Error(f"expected a tensor or a shape, got {type(value).__name__}") from exc
