"""Bind the engine to a loaded Qwen3.5 module tree (ComfyUI's or the standalone loader's).

The binding only finds modules and checks that they are Qwen3.5; it never copies weights. It
calls the tree's own Linear / Embedding / norm modules, so ComfyUI's quantized ops, weight
casting and offloading keep working. The one weight read directly is the tied output projection
(``embed_tokens`` used as ``lm_head``): where the application casts weights per call, its layer
hands ``bind`` a ``weight_cast`` hook (ComfyUI's: ``patches.comfy_bridge.comfy_weight_cast``,
the way ComfyUI's ``BaseGenerate.logits`` does it); the engine imports nothing of ComfyUI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import MAX_DECODE_ROWS
from .config import Qwen35Config
from .draft_vocab import draft_ids, pad
from .errors import Qwen35Error
from .plain_weights import PlainLinear, StandaloneWeights, first_rows, linear_rows

#: ``weight_cast(module, h)`` -> context manager yielding the cast weight, or None (see ``bind``).
WeightCast = Callable[[Any, torch.Tensor], AbstractContextManager]

_LINEAR_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log", "norm",
                 "out_proj")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_MTP_PARTS = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "layers")


def _is_decoder(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("embed_tokens", "layers", "norm"))


class Qwen35Binding:
    """A Qwen3.5 decoder bound for the engine.

    Attributes: ``transformer`` (the decoder: ``embed_tokens``, ``layers``, ``norm``, optional
    ``lm_head``), ``root`` (what was passed to ``bind``), ``config`` (``Qwen35Config``), ``layers``
    (the decoder layers). ``mtp_hidden`` selects
    the hidden state fed to the MTP head: "normed" (after the model's final norm; vLLM/SGLang
    convention, default) or "prenorm". ``weight_cast`` and ``weights``: see ``bind``.
    ``plain_output``: the output projection as a ``PlainLinear`` for decode rows, set by the runner
    stack for one generation when its fused plan resolved it (None: the module is called);
    ``plain_embedding``: likewise the embedding table ``[V, H]`` read in place (None: the module).
    ``draft_vocab``: the ids MTP drafts may rank (``engine/draft_vocab.py``): the first
    ``draft_vocab`` (the released tokenizer's BPE ids), or None (all).
    """

    def __init__(self, transformer: Any, root: Any, config: Qwen35Config, weight_cast: WeightCast | None = None,
                 weights=None):
        self.transformer = transformer
        self.weight_cast = weight_cast
        self.weights = weights if weights is not None else StandaloneWeights()
        self.plain_output: PlainLinear | None = None
        self.draft_vocab: int | None = draft_ids(config.vocab_size)
        self.plain_embedding: torch.Tensor | None = None
        self.root = root
        self.config = config
        self.layers = list(transformer.layers)
        self.mtp_hidden = "normed"
        self._holding = False
        self._held: tuple | None = None  # (key, output weight cast for the execution dtype)

    @contextlib.contextmanager
    def holding_output_weight(self):
        """Within this block, the output projection's weight cast (tied ``embed_tokens`` or
        ``lm_head``, vocab x hidden) is made once per execution dtype and reused by every ``logits``
        call instead of once per call. Only where the cast is a plain in-memory dtype change on the
        CPU (no device transfer, no weight patches): there a cast of the 248k-row table costs more
        than the matmul, and an MTP step needs one per draft. The values are the same casts."""
        self._holding, self._held = True, None
        try:
            yield self
        finally:
            self._holding, self._held = False, None

    # ------------------------------------------------------------------ MTP head
    @property
    def mtp(self) -> Any | None:
        """The MTP head at ``<transformer>.mtp`` (or ``<root>.mtp``), or None. Checked on every access,
        so a head grafted after ``bind`` is found."""
        head = getattr(self.transformer, "mtp", None)
        if head is None and self.root is not self.transformer:
            head = getattr(self.root, "mtp", None)
        if head is None:
            return None
        _check_mtp(head, self.config)
        return head

    # ------------------------------------------------------------------ embeddings / logits
    def embed(self, ids: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
        """Token embeddings: ids int64 ``[B,S]`` -> ``[B,S,H]`` in ``dtype`` on ``device`` (rows of
        ``plain_embedding`` when the plan read the table in place: no module call per token)."""
        ids = ids.to(device)
        table = self.plain_embedding
        if table is not None and table.device == ids.device:
            return F.embedding(ids, table).to(dtype)
        out = self.transformer.embed_tokens(ids)
        return out.to(device=device, dtype=dtype)

    @property
    def output_module(self):
        """The output projection: ``lm_head``, or the tied ``embed_tokens``."""
        head = getattr(self.transformer, "lm_head", None)
        return head if head is not None else self.transformer.embed_tokens

    def logits(self, h: torch.Tensor, *, cast: bool = True, vocab: int | None = None) -> torch.Tensor:
        """Output logits: h ``[B,S,H]`` -> float32 ``[B,S,V]`` (``cast=False``: in the dtype the
        output projection computed them in, for an argmax, which the exact cast would not change).
        ``vocab``: only ids below it are ranked, the logits of the others are -inf; where the output
        weight is read in place only its first ``vocab`` rows are read (a draft's projection)."""
        if vocab is not None and vocab < self.config.vocab_size:
            rows = self._plain(h)
            rows = None if rows is None else first_rows(rows, vocab)  # views: nothing kept past the call
            if rows is not None:
                out = pad(linear_rows(h, rows), self.config.vocab_size)
            else:
                out = self._project(h)
                out[..., vocab:] = float("-inf")
        else:
            out = self._project(h)
        return out.float() if cast else out

    def _plain(self, h: torch.Tensor) -> PlainLinear | None:
        """``plain_output`` where the decode-row product takes ``h``, else None (the module)."""
        plain = self.plain_output
        if plain is not None and h.shape[0] * h.shape[1] <= MAX_DECODE_ROWS and h.device == plain.weight.device \
                and (plain.quantized or h.dtype == plain.weight.dtype):
            return plain
        return None

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        plain = self._plain(h)
        if plain is not None:
            return linear_rows(h, plain)
        head = getattr(self.transformer, "lm_head", None)
        held = self._held_weight(head if head is not None else self.transformer.embed_tokens, h)
        if held is not None:
            return F.linear(h, held)
        if head is not None:
            return head(h)
        module = self.transformer.embed_tokens
        if self.weight_cast is not None:
            with self.weight_cast(module, h) as weight:
                if weight is not None:
                    return F.linear(h, weight, None)
        w = module.weight
        if w.dtype != h.dtype or w.device != h.device:
            w = w.to(h)
        return F.linear(h, w)

    def _held_weight(self, module, h: torch.Tensor) -> torch.Tensor | None:
        """The output weight cast once for ``h``'s dtype while holding (see ``holding_output_weight``)."""
        if not self._holding or h.device.type != "cpu":
            return None
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, torch.nn.Parameter) or \
                w.device != h.device or getattr(module, "bias", None) is not None or \
                getattr(module, "weight_function", None) or getattr(module, "bias_function", None):
            return None
        key = (id(module), h.dtype)  # weights do not change within one generation
        if self._held is None or self._held[0] != key:
            weight = None
            if self.weight_cast is not None:
                with self.weight_cast(module, h) as cast:
                    weight = cast
            if weight is None:
                weight = w if w.dtype == h.dtype else w.to(h.dtype)
            self._held = (key, weight.detach())
        return self._held[1]


def _missing(obj: Any, names) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def _check_layers(layers, config: Qwen35Config) -> None:
    if len(layers) != config.num_hidden_layers:
        raise Qwen35Error(f"module tree has {len(layers)} layers but its config says {config.num_hidden_layers}")
    for i, (layer, kind) in enumerate(zip(layers, config.layer_types)):
        miss = _missing(layer, _LAYER_PARTS) or [f"mlp.{n}" for n in _missing(layer.mlp, _MLP_PARTS)]
        if kind == "linear_attention":
            sub = getattr(layer, "linear_attn", None)
            miss += ["linear_attn"] if sub is None else [f"linear_attn.{n}" for n in _missing(sub, _LINEAR_PARTS)]
        else:
            sub = getattr(layer, "self_attn", None)
            miss += ["self_attn"] if sub is None else [f"self_attn.{n}" for n in _missing(sub, _ATTN_PARTS)]
        if miss:
            raise Qwen35Error(f"layers[{i}] ({kind}) lacks {miss}: not a Qwen3.5 module tree")


def _check_mtp(head: Any, config: Qwen35Config) -> None:
    miss = _missing(head, _MTP_PARTS)
    if not miss:
        layers = list(head.layers)
        if len(layers) != 1:
            raise Qwen35Error(f"MTP head has {len(layers)} layers; this engine supports exactly 1 (Qwen3.5)")
        miss = [f"layers.0.{n}" for n in _missing(layers[0], _LAYER_PARTS + ("self_attn",))] or \
            [f"layers.0.mlp.{n}" for n in _missing(layers[0].mlp, _MLP_PARTS)] + \
            [f"layers.0.self_attn.{n}" for n in _missing(layers[0].self_attn, _ATTN_PARTS)]
    if miss:
        raise Qwen35Error(f"MTP head lacks {miss}; build it with engine.build_mtp_head(tensors, config)")
    w = getattr(head.fc, "weight", None)
    if w is not None and tuple(w.shape) != (config.hidden_size, 2 * config.hidden_size):
        raise Qwen35Error(f"MTP head fc.weight has shape {tuple(w.shape)}, expected "
                          f"({config.hidden_size}, {2 * config.hidden_size}) for this model: wrong MTP file")


def _config_of(transformer: Any) -> Qwen35Config:
    cfg = getattr(transformer, "config", None)
    if isinstance(cfg, Qwen35Config):
        return cfg
    if cfg is not None and hasattr(cfg, "linear_num_value_heads") and hasattr(cfg, "layer_types"):
        return Qwen35Config.from_object(cfg, mtp_num_hidden_layers=0)
    shapes = {k: v.shape for k, v in transformer.state_dict(keep_vars=True).items()
              if not k.startswith("mtp.")}
    return Qwen35Config.from_state_dict(shapes)


def bind(module: Any, *, weight_cast: WeightCast | None = None, weights=None) -> Qwen35Binding:
    """Bind a Qwen3.5 tree: ComfyUI's ``Qwen35`` (BaseGenerate) instance, its ``.model``
    (``Qwen35Transformer``), the standalone loader's model, or an existing binding (returned as is;
    a ``weight_cast`` / ``weights`` given then is set on it).

    ``weight_cast(module, h)``: a context manager yielding ``module``'s weight cast for ``h`` (its
    dtype and device) when the application casts that module's weights per call, else None; the
    weight is used inside the block. Without it weights are read as they are (``.to(h)``).
    ``weights``: how the decode kernels read module weights in place (``linear``, ``tensor_reason``,
    ``module_call_reason``, as ``plain_weights.StandaloneWeights``, the default); the layer that
    loaded the model in its own formats passes its own (ComfyUI's: ``patches.comfy_weights.Resolver``).

    Raises Qwen35Error (naming the missing part) when the tree is not Qwen3.5.
    """
    if isinstance(module, Qwen35Binding):
        if weight_cast is not None:
            module.weight_cast = weight_cast
        if weights is not None:
            module.weights = weights
        return module
    if _is_decoder(module):
        transformer = module
    elif _is_decoder(getattr(module, "model", None)):
        transformer = module.model
    else:
        raise Qwen35Error(f"{type(module).__name__} is not a Qwen3.5 model: expected a module with "
                          "embed_tokens/layers/norm, or one whose .model has them (ComfyUI's Qwen35)")
    layers = list(transformer.layers)
    if not any(hasattr(layer, "linear_attn") for layer in layers):
        raise Qwen35Error(f"{type(transformer).__name__} has no Gated DeltaNet layers (layers[i].linear_attn): "
                          "not Qwen3.5")
    config = _config_of(transformer)
    kinds = tuple("linear_attention" if hasattr(layer, "linear_attn") else "full_attention" for layer in layers)
    if kinds != config.layer_types:
        raise Qwen35Error("the layers' kinds (linear_attn / self_attn) disagree with config.layer_types")
    _check_layers(layers, config)
    binding = Qwen35Binding(transformer, module, config, weight_cast, weights)
    if binding.mtp is not None:
        binding.config = config.replace(mtp_num_hidden_layers=1)
    return binding
