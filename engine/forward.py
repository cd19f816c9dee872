"""Qwen3.5 forward pass over S new rows on top of a ``ModelCache`` (prefill, decode, MTP verify).

Every layer stages its S rows in the cache (K/V written, DeltaNet state after each row kept);
the caller then commits how many rows it keeps. Attention over the cache goes through
``kernels.decode_attention`` when S <= 8 (cost follows the filled length), and through torch SDPA
over the filled prefix for longer prompts. The DeltaNet recurrence runs row by row (keeping a
state per row) for short inputs and chunked for prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import HEAD_DIMS, MAX_DECODE_ROWS, decode_attention
from .binding import Qwen35Binding
from .cache import DeltaNetState, KVCache, ModelCache
from .deltanet import chunked_rows, gates, prepare_qk, recurrent_rows
from .fused import FusedPlan
from .int8_rows import int8_rows, int8_rows_ok
from .plain_weights import PlainLinear
from .rope import Rope, apply_rope

#: Longest input whose DeltaNet rows run one by one (longer inputs use the chunked form).
ROWWISE_MAX = 16


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last S rows over a filled prefix (SDPA).

    q ``[B,Hq,S,D]``, k, v ``[B,Hkv,L,D]`` (L >= S, the S new rows last) -> ``[B,Hq,S,D]``.
    """
    s, length = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if s == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = torch.arange(s, device=q.device).view(s, 1) + (length - s)
    mask = torch.arange(length, device=q.device).view(1, length) <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def deltanet_constants(binding: Qwen35Binding, device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per DeltaNet layer index: ``(-exp(A_log), dt_bias)``, float32 on ``device`` (the step's gate terms)."""
    out = {}
    for i, layer in enumerate(binding.layers):
        if binding.config.layer_types[i] == "linear_attention":
            la = layer.linear_attn
            out[i] = (-la.A_log.detach().to(device, torch.float32).exp(), la.dt_bias.detach().to(device, torch.float32))
    return out


class Runner:
    """Runs the bound model on a cache. One per generation (it caches per-device constants)."""

    def __init__(self, binding: Qwen35Binding, cache: ModelCache, *, dtype: torch.dtype, device,
                 attention: str = "auto", fused: FusedPlan | None = None):
        self.binding = binding
        self.fused = fused  # S <= 8 rows run through the fused kernels when given (FusedPlan.build)
        self.cfg = binding.config
        self.cache = cache
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention = attention
        cfg = self.cfg
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved, self.device)
        # Module path: (N, K) of int8 weights whose several-row products ``int8_rows`` computes instead
        # of the module (``GraphRunner`` adds a shape whose module call failed a capture); the
        # module of the last call that raised; each module's int8 weight read in place, or None.
        self.int8_shapes: set[tuple[int, int]] = set()
        self.failed_module = None
        self._int8: dict[int, PlainLinear | None] = {}
        self._consts = deltanet_constants(binding, self.device)

    # ------------------------------------------------------------------ model
    def forward(self, x: torch.Tensor, pos: torch.Tensor, *, keep_rows: bool = True):
        """Stage S rows in every layer. x ``[B,S,H]`` (execution dtype), pos int64 ``[3,S]``.

        Returns ``(hidden, prenorm)``: the final hidden after the model norm and before it, both
        ``[B,S,H]``. ``keep_rows`` keeps the DeltaNet state after every row (needed to commit fewer
        than S rows); without it long inputs use the chunked recurrence.
        """
        if self.fused is not None and x.shape[1] <= MAX_DECODE_ROWS:
            return self._forward_fused(x, *self._fused_tables(pos))
        cos, sin = self.rope.tables(pos)
        for i, layer in enumerate(self.binding.layers):
            state = self.cache.layers[i]
            xn = layer.input_layernorm(x)
            if isinstance(state, DeltaNetState):
                mixed = self._deltanet(i, layer.linear_attn, xn, state, keep_rows)
            else:
                mixed = self._attention(layer.self_attn, xn, state, cos, sin)
            x = x + mixed
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return self.binding.transformer.norm(x), x

    def _fused_tables(self, pos: torch.Tensor):
        """``Rope.tables(pos)`` in one launch (the fused path's decode rows)."""
        return self.fused.ops.rope_tables(pos, self.rope.inv_freq, self.rope.axis)

    def _forward_fused(self, x: torch.Tensor, cos, sin):
        """``forward`` for S <= 8 rows through the fused kernels (same contract, rows always kept)."""
        plan, cfg = self.fused, self.cfg
        s = x.shape[1]
        # Every DeltaNet layer's per-row states and conv window, staged together for one commit copy.
        states, windows = self.cache.staging_buffers(s)
        j, mixed = 0, None
        for i, layer in enumerate(self.binding.layers):
            state = self.cache.layers[i]
            xn, x = plan.norm(f"layers.{i}.input_layernorm", x, mixed)
            if isinstance(state, DeltaNetState):
                neg_a, dt_bias = self._consts[i]
                mixed = plan.deltanet(i, layer.linear_attn, xn, state, neg_a, dt_bias, cfg.linear_num_key_heads,
                                      states[j], windows[j])
                j += 1
            else:
                mixed = self._attention_fused(f"layers.{i}.self_attn", layer.self_attn, xn, state, cos, sin)
            xn, x = plan.norm(f"layers.{i}.post_attention_layernorm", x, mixed)
            mixed = plan.mlp(i, xn)
        self.cache.stage_deltanet(states, windows, s)
        return plan.norm("norm", x, mixed)

    def _attention_fused(self, prefix: str, attn, xn: torch.Tensor, kv: KVCache, cos, sin) -> torch.Tensor:
        cfg = self.cfg
        q, gate, lengths = self.fused.qk(prefix, attn, xn, cos, sin, cfg.head_dim, cfg.num_attention_heads,
                                         cfg.num_key_value_heads, kv)
        return self.fused.attend(attn.o_proj, q, kv, lengths, gate, self.attention)

    def forward_logits(self, x: torch.Tensor, pos: torch.Tensor):
        """``forward`` (decode or verify rows), then the output logits of every row: ``(hidden,
        prenorm, logits)``, logits float32 ``[B,S,V]`` (``binding.logits``)."""
        hidden, pre = self.forward(x, pos)
        return hidden, pre, self.binding.logits(hidden)

    def forward_token(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The greedy decode step of one row: ids int64 ``[1,1]`` (the last token, on the device),
        pos int64 ``[3,1]`` -> the argmax of the next logits, written over ``ids`` and returned as
        its int64 ``[1]`` view (graph friendly: a replay reads the token the last one wrote).
        The embedding, ``forward``, the output projection in its own dtype and the argmax
        (``kernels/argmax.py`` where the fused kernels run, else torch's: the same index)."""
        return self.forward_token_hidden(ids, pos)[0]

    def forward_token_hidden(self, ids: torch.Tensor, pos: torch.Tensor):
        """``forward_token``, also returning the step's hidden states: ``(token int64 [1], hidden
        [1,1,H], prenorm [1,1,H])`` (``forward``'s pair; the MTP head's input for this row)."""
        if ids.shape != (1, 1) or ids.dtype != torch.int64:
            raise ValueError(f"forward_token takes int64 ids [1, 1], got {ids.dtype} {tuple(ids.shape)}")
        hidden, pre = self.forward(self.binding.embed(ids, self.dtype, self.device), pos)
        logits = self.binding.logits(hidden, cast=False).reshape(1, -1)
        token = ids.view(1)
        argmax = self._argmax_kernels(logits)
        if argmax is not None:
            return argmax.argmax_rows(logits, out=token), hidden, pre
        return token.copy_(logits.argmax(dim=-1)), hidden, pre

    def _argmax_kernels(self, logits: torch.Tensor):
        """``kernels.argmax`` when the fused path runs and its kernels take these logits, else None."""
        if self.fused is None:
            return None
        from ..kernels.capabilities import triton_module

        module, _ = triton_module("argmax")
        return module if module is not None and module.argmax_reason(logits) is None else None

    def mtp_logits(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor,
                   row: torch.Tensor | None = None, vocab: int | None = None):
        """``mtp_forward``, then the output logits of its last row (the draft's): ``(normed
        [B,S,H], logits float32 [B,1,V])``. ``row`` (int64 ``[1]`` on the device): that row's
        instead, ``(normed row [B,1,H], its logits [B,1,V])``, picked on the device. ``vocab``:
        the draft vocabulary (``binding.logits``; None: every id)."""
        out = self.mtp_forward(hidden, emb, pos)
        if row is not None:
            out = out.index_select(1, row)
            return out, self.binding.logits(out, vocab=vocab)
        return out, self.binding.logits(out[:, -1:], vocab=vocab)

    def mtp_forward(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Stage S rows of the MTP head in ``cache.mtp``: hidden, emb ``[B,S,H]`` -> normed ``[B,S,H]``.

        ``fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(hidden)])``, one full-attention
        layer, then the head's own ``norm`` (vLLM's Qwen3.5 MTP order).
        """
        head = self.binding.mtp
        if self.fused is not None and hidden.shape[1] <= MAX_DECODE_ROWS:
            plan = self.fused
            cos, sin = self._fused_tables(pos)
            e, _ = plan.norm("mtp.pre_fc_norm_embedding", emb)
            h, _ = plan.norm("mtp.pre_fc_norm_hidden", hidden)
            x = plan.lin(head.fc, torch.cat([e, h], dim=-1))
            layer = head.layers[0]
            xn, _ = plan.norm("mtp.layers.0.input_layernorm", x)
            mixed = self._attention_fused("mtp.layers.0.self_attn", layer.self_attn, xn, self.cache.mtp, cos, sin)
            xn, x = plan.norm("mtp.layers.0.post_attention_layernorm", x, mixed)
            return plan.norm("mtp.norm", x, plan.mlp("mtp", xn))[0]
        cos, sin = self.rope.tables(pos)
        x = self._lin(head.fc, torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = head.layers[0]
        x = x + self._attention(layer.self_attn, layer.input_layernorm(x), self.cache.mtp, cos, sin)
        x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return head.norm(x)

    # ------------------------------------------------------------------ module calls
    def _lin(self, module, x: torch.Tensor) -> torch.Tensor:
        """A projection of the module path: the module's own call, but a product of 2..8 decode rows
        whose int8 weight shape is in ``int8_shapes`` goes to ``int8_rows`` (the same weight, read in
        place). A call that raises is remembered (``failed_module``) for ``GraphRunner``."""
        if self.int8_shapes and 1 < x.shape[0] * x.shape[1] <= MAX_DECODE_ROWS:
            plain = self.int8_weight(module)
            if plain is not None and tuple(plain.weight.shape) in self.int8_shapes:
                return int8_rows(x, plain)
        try:
            return module(x)
        except Exception:
            self.failed_module = module
            raise

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` through ``_lin`` (``act``: the module's, ComfyUI's MLP names
        it; SiLU otherwise)."""
        act = getattr(mlp, "activation", F.silu)
        return self._lin(mlp.down_proj, act(self._lin(mlp.gate_proj, x)) * self._lin(mlp.up_proj, x))

    def int8_weight(self, module) -> PlainLinear | None:
        """The module's int8 weight as the binding's weight hook reads it in place, when
        ``int8_rows`` can use it; else None (once per module)."""
        key = id(module)
        if key not in self._int8:
            plain, _ = self.binding.weights.linear(module, self.device, self.dtype)
            self._int8[key] = plain if int8_rows_ok(plain) else None
        return self._int8[key]

    # ------------------------------------------------------------------ mixers
    def _attention(self, attn, xn: torch.Tensor, kv: KVCache, cos, sin) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = xn.shape
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qg = self._lin(attn.q_proj, xn).view(b, s, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, s, hq * d)
        k = self._lin(attn.k_proj, xn).view(b, s, hkv, d)
        v = self._lin(attn.v_proj, xn).view(b, s, hkv, d).transpose(1, 2)
        q = apply_rope(attn.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_norm(k).transpose(1, 2), cos, sin)
        lengths = kv.write(k, v)
        if s <= MAX_DECODE_ROWS and d in HEAD_DIMS:
            o = decode_attention(q.contiguous(), kv.k, kv.v, lengths, causal=True, backend=self.attention,
                                 span=kv.span())
        else:
            o = prefix_attention(q, *kv.filled())
        o = o.transpose(1, 2).reshape(b, s, hq * d) * torch.sigmoid(gate)
        return self._lin(attn.o_proj, o)

    def _deltanet(self, index: int, la, xn: torch.Tensor, state: DeltaNetState, keep_rows: bool) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = xn.shape
        kernel = cfg.conv_kernel_size
        qkv = self._lin(la.in_proj_qkv, xn)
        z = self._lin(la.in_proj_z, xn)
        beta_in = self._lin(la.in_proj_b, xn)
        a_in = self._lin(la.in_proj_a, xn)
        window = torch.cat([state.conv.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
        mixed = F.silu(la.conv1d(window)[..., kernel - 1:kernel - 1 + s]).transpose(1, 2)
        qk = mixed[..., :2 * cfg.key_dim].unflatten(-1, (2, cfg.linear_num_key_heads, cfg.linear_key_head_dim))
        v = mixed[..., 2 * cfg.key_dim:].reshape(b, s, cfg.linear_num_value_heads, cfg.linear_value_head_dim).float()
        neg_a, dt_bias = self._consts[index]
        g, beta = gates(a_in, beta_in, neg_a, dt_bias)
        q, k = prepare_qk(qk, cfg.linear_num_value_heads)
        if keep_rows or s <= ROWWISE_MAX:
            out, states = recurrent_rows(state.recurrent, q, k, v, g, beta)
            if not keep_rows:
                states = states[-1:]
        else:
            out, final = chunked_rows(state.recurrent, q, k, v, g, beta)
            states = [final]
        state.stage(states, window, s)
        dv = cfg.linear_value_head_dim
        o = la.norm(out.to(xn.dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(b, s, cfg.value_dim)
        return self._lin(la.out_proj, o)
