"""Fused decode/verify rows: the per-layer small ops of a Qwen3.5 step as a few Triton launches.

For S <= 8 rows (decode, MTP draft and verify) a layer runs as: residual add + RMSNorm (one
kernel), the layer's projections (read in place as ``PlainLinear`` records where the binding's
weight hook resolves them: bf16 and int8 through the Triton GEMV, projections sharing an input in
one launch; else the Linear module's own call), one fused kernel for the
rest of the mixer (DeltaNet: conv, norms, gates, recurrence
and gated norm; attention: q/k RMSNorm + RoPE, the length-aware decode kernel, the sigmoid gate),
residual add + RMSNorm, and the MLP with a fused SiLU-multiply. The torch path in ``forward.py``
computes the same function (prefill always uses it).

Two launch savings for ComfyUI's int8 ConvRot weights and the 4096-wide outputs: the norm, SiLU
and gate kernels and the DeltaNet step's gated norm also write their output ConvRot-rotated when
int8 ConvRot projections read it (``norm_rotation``; the projections then skip their own rotation
launch), and a projection whose output only feeds the next norm (``into_norm``: DeltaNet out,
attention o, MLP down) returns split-K float32 partials (``kernels/launch.py``) that the norm
kernel sums.

``FusedPlan.build`` reads the norm weights once (as each norm module would apply them), resolves
the projections, and says why fusion is impossible when a module is not the plain Qwen3.5 kind
(an unknown norm class, norm/conv weights the hook cannot read in place, no usable Triton).
"""

from __future__ import annotations

import logging

import torch

from ..kernels import (
    ATTENTION_BACKENDS,
    decode_attention,
    launch,
    resolve_backend,
    triton_device_reason,
    triton_module,
)
from .fused_parts import (
    Deferred,
    Reject,
    embedding_table,
    mlp_parts,
    norm_weight,
    projections,
    resident,
    triton_ops,
)
from .plain_weights import linear_group, linear_rows, split_of

log = logging.getLogger(__name__)


class FusedPlan:
    """Prepared constants of the fused path: per layer the input/post norm weights, and for DeltaNet
    layers the conv weight ``[C,K]`` and gated-norm weight; for attention layers the q/k norm
    weights; the same for the MTP head. ``linears``: the projections read in place
    (``id(module) -> PlainLinear``, see ``engine/plain_weights.py``); ``unresolved``: the others
    (``name -> why``; ``unresolved_modules``: ``name -> module``), which run through their module's
    own call; ``output``: the output projection's record, or None."""

    def __init__(self, ops, norms: dict, convs: dict, mlps: dict, eps: float, linears: dict | None = None,
                 unresolved: dict | None = None, output=None, formats: dict | None = None,
                 unresolved_modules: dict | None = None):
        self.ops, self.step = ops
        self.norms, self.convs, self.mlps, self.eps = norms, convs, mlps, eps
        self.linears = linears or {}
        self.unresolved = unresolved or {}
        self.unresolved_modules = unresolved_modules or {}  # name -> the module called instead
        self.output = output
        self.formats = formats or {}  # "int8" / dtype name -> count of resolved projections
        # ConvRot: the group size the int8 projections fed by each norm expect (the norm's kernel
        # writes its output rotated too), and the most recent such output: (y, G, y rotated).
        self.norm_rotation: dict[str, int] = {}
        # The norms whose every reader is a projection read in place: their factor is deferred.
        self.deferred: set[str] = set()
        self._rotated: tuple | None = None
        self.embedding: torch.Tensor | None = None  # the embedding table read in place, or None
        self.prefetch: dict[int, torch.Tensor] = {}  # see _prefetch_chain
        self.prefetch_bytes: dict[int, int] = {}  # the mixer inputs' prefetch length (_prefetch_chain)

    @classmethod
    def build(cls, binding, device, dtype: torch.dtype) -> tuple[FusedPlan | None, str | None]:
        """``(plan, None)``, or ``(None, reason)`` when the fused path cannot run for this model."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if triton_device_reason(device) is not None:
            return None, f"the fused kernels need a CUDA device (running on {device.type})"
        ops, why = triton_ops()
        if ops is None:
            return None, why
        cfg = binding.config
        probe = torch.empty(1, 1, cfg.conv_dim, dtype=dtype, device=device)
        why = ops[1].step_reason(probe, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_kernel_size)
        if why is not None:
            return None, f"the fused DeltaNet kernel does not support this model: {why}"
        weights = binding.weights
        norms, convs, mlps, eps = {}, {}, {}, set()

        def norm(mod, key):
            w, e = norm_weight(weights, mod, dtype, device, key)
            norms[key] = w
            eps.add(e)

        try:
            for i, layer in enumerate(binding.layers):
                norm(layer.input_layernorm, f"layers.{i}.input_layernorm")
                norm(layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
                mlps[i] = mlp_parts(layer.mlp, f"layers.{i}.mlp")
                if cfg.layer_types[i] == "linear_attention":
                    la = layer.linear_attn
                    norm(la.norm, f"layers.{i}.linear_attn.norm")
                    conv, name = la.conv1d, f"layers.{i}.linear_attn.conv1d"
                    resident(weights, conv, name, device)
                    if getattr(conv, "bias", None) is not None:
                        raise Reject(f"{name} has a bias")
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
                mlps["mtp"] = mlp_parts(layer.mlp, "mtp.layers.0.mlp")
        except Reject as exc:
            return None, str(exc)
        if len(eps) != 1:
            return None, f"the norms use different eps values {sorted(eps)}"
        linears, unresolved, modules, formats, output = {}, {}, {}, {}, None
        for name, mod in projections(binding):
            plain, why = weights.linear(mod, device, dtype)
            if plain is None:
                unresolved[name], modules[name] = why, mod
                continue
            linears[id(mod)] = plain
            formats[plain.kind] = formats.get(plain.kind, 0) + 1
            if mod is binding.output_module:
                output = plain
        plan = cls(ops, norms, convs, mlps, eps.pop(), linears, unresolved, output, formats, modules)
        plan.norm_rotation = plan._norm_rotations(binding)
        plan.deferred = {key for key, readers in plan._norm_readers(binding).items()
                         if all(id(m) in linears for m in readers)}
        plan.embedding = embedding_table(weights, binding.transformer.embed_tokens, device)
        plan.prefetch, plan.prefetch_bytes = plan._prefetch_chain(binding, launch.prefetch(device)[1])
        return plan, None

    def _prefetch_chain(self, binding, mixer_bytes: int) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """``id(first module of a product) -> the next product's first weight`` along a decode step
        (each layer's mixer input, mixer output, gate/up and down, then the output projection), for
        the products read in place whose successor is too; and ``id -> mixer_bytes`` for each mixer
        input among them (its successor, the mixer's output projection, runs after the mixer itself)."""
        cfg, chain, mixer_inputs = binding.config, [], set()
        for i, layer in enumerate(binding.layers):
            if cfg.layer_types[i] == "linear_attention":
                chain += [layer.linear_attn.in_proj_qkv, layer.linear_attn.out_proj]
            else:
                chain += [layer.self_attn.q_proj, layer.self_attn.o_proj]
            mixer_inputs.add(id(chain[-2]))
            gate, _, down = mlp_parts(layer.mlp, f"layers.{i}.mlp")
            chain += [gate, down]
        chain.append(binding.output_module)
        out = {}
        for a, b in zip(chain, chain[1:]):
            pa, pb = self.linears.get(id(a)), self.linears.get(id(b))
            if pa is not None and pb is not None:
                out[id(a)] = pb.weight
        return out, {key: mixer_bytes for key in mixer_inputs if key in out}

    def _rotation_of(self, modules) -> int:
        """The ConvRot group size of the first int8 ConvRot projection among ``modules`` (0: none)."""
        for m in modules:
            plain = self.linears.get(id(m))
            if plain is not None and plain.quantized and plain.convrot:
                return plain.convrot
        return 0

    @staticmethod
    def _norm_readers(binding) -> dict[str, tuple]:
        """``norm key -> the projections that read its output`` for the layer norms (and the MTP
        layer's); the model's final norms and the MTP head's input norms have other readers."""
        cfg, out = binding.config, {}
        layers = [(f"layers.{i}", layer, cfg.layer_types[i]) for i, layer in enumerate(binding.layers)]
        if binding.mtp is not None:
            layers.append(("mtp.layers.0", binding.mtp.layers[0], "full_attention"))
        for prefix, layer, kind in layers:
            if kind == "linear_attention":
                la = layer.linear_attn
                mixer = (la.in_proj_qkv, la.in_proj_z, la.in_proj_a, la.in_proj_b)
            else:
                mixer = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            out[f"{prefix}.input_layernorm"] = mixer
            out[f"{prefix}.post_attention_layernorm"] = mlp_parts(layer.mlp, f"{prefix}.mlp")[:2]
        return out

    def _norm_rotations(self, binding) -> dict[str, int]:
        """``norm key -> G`` for the norms whose output feeds int8 ConvRot-G projections directly."""
        out = {key: self._rotation_of(readers) for key, readers in self._norm_readers(binding).items()}
        return {k: g for k, g in out.items() if g}

    def describe(self) -> str:
        """One line: how many projections are read in place (by format) and which are not, and why."""
        done = sum(self.formats.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.formats.items()))
        line = f"{done} of {done + len(self.unresolved)} projections read in place ({kinds or 'none'})"
        if self.unresolved:
            by_reason: dict[str, list[str]] = {}
            for name, why in self.unresolved.items():
                by_reason.setdefault(why, []).append(name)
            parts = [f"{names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + f": {why}"
                     for why, names in by_reason.items()]
            line += "; through their module call (slower): " + "; ".join(parts)
        return line

    def lin(self, module, x: torch.Tensor, rotated=None, *, into_norm: bool = False) -> torch.Tensor:
        """One projection of decode rows: in place when resolved, else the module's own call.
        ``rotated``: ``(G, x rotated)`` when the producer of x rotated it. ``into_norm``: the output
        only feeds ``norm`` as its residual, so a split-K product may return its float32 partials."""
        plain = self.linears.get(id(module))
        if plain is None:
            return module(x)
        split = self._split(plain, x.numel() // x.shape[-1]) if into_norm else 1
        return linear_rows(x, plain, rotated=rotated, split=split, prefetch=self.prefetch.get(id(module)),
                           prefetch_bytes=self.prefetch_bytes.get(id(module)))

    def _split(self, plain, rows: int) -> int:
        return split_of(plain, rows)

    def lins(self, modules, x) -> list[torch.Tensor]:
        """Projections of the same rows x (grouped into one launch where they are int8; x's rotated
        twin from the norm that produced it, when there is one). x ``[B,S,H]`` or a ``Deferred``
        norm output (``norm``), whose factor the GEMV applies."""
        plains = [self.linears.get(id(m)) for m in modules]
        if all(p is not None for p in plains):
            nxt, nbytes = self.prefetch.get(id(modules[0])), self.prefetch_bytes.get(id(modules[0]))
            if isinstance(x, Deferred):
                return linear_group(x.rows, plains, rotated=x.rotated, row_norm=x.norm, prefetch=nxt,
                                    prefetch_bytes=nbytes)
            last = self._rotated
            rotated = (last[1], last[2]) if last is not None and last[0] is x else None
            return linear_group(x, plains, rotated=rotated, prefetch=nxt, prefetch_bytes=nbytes)
        if isinstance(x, Deferred):  # a module reads it: the norm's output itself
            x = x.materialize()
        return [self.lin(m, x) for m in modules]

    # ------------------------------------------------------------------ building blocks
    def norm(self, key: str, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``(rms_norm(x + residual), x + residual)`` with the weight of norm ``key``. x ``[B,S,H]``;
        residual ``[B,S,H]`` or a split-K product's float32 partials ``[P,B,S,H]``. Where int8
        ConvRot projections read the output, the kernel also writes it rotated (kept for ``lins``).
        For a norm in ``deferred`` the first is a ``Deferred`` (for ``lins`` only): no program of the
        norm's kernel then reads the whole row (measured in ``kernels/row_norm.py``)."""
        group = self.norm_rotation.get(key, 0)
        if key in self.deferred:
            out = self.ops.add_rms_norm(x, residual, self.norms[key], self.eps, rotate=group, defer=True)
            return Deferred(out[0], out[-1], (group, out[2]) if group else None), out[1]
        if not group:
            return self.ops.add_rms_norm(x, residual, self.norms[key], self.eps)
        y, h, y_rot = self.ops.add_rms_norm(x, residual, self.norms[key], self.eps, rotate=group)
        self._rotated = (y, group, y_rot)
        return y, h

    def mlp(self, key, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: x ``[B,S,H]`` -> ``[B,S,H]`` (or split-K partials ``[P,B,S,H]``, for ``norm``)."""
        gate, up, down = self.mlps[key]
        g, u = self.lins((gate, up), x)
        group = self._rotation_of((down,))
        if not group:
            return self.lin(down, self.ops.silu_mul(g, u), into_norm=True)
        act, act_rot = self.ops.silu_mul(g, u, rotate=group)
        return self.lin(down, act, (group, act_rot), into_norm=True)

    def qk(self, prefix: str, attn, xn: torch.Tensor, cos, sin, head_dim: int, hq: int, hkv: int, kv):
        """The attention inputs of rows xn ``[B,S,H]``: returns q ``[B,Hq,S,D]`` (normed, rotated), the
        gate ``[B,S,Hq,D]`` view and the device length of ``kv`` after k (normed, rotated) and v were
        staged in it: one kernel for both norms, writing k and v into the cache itself."""
        b, s, _ = xn.shape
        qg, k, v = self.lins((attn.q_proj, attn.k_proj, attn.v_proj), xn)
        qg = qg.view(b, s, hq, 2 * head_dim)
        k = k.view(b, s, hkv, head_dim)
        v = v.view(b, s, hkv, head_dim)
        q = []  # q comes out of the same launch that writes k and v into the cache
        lengths = kv.write_rows(s, lambda kc, vc, length: q.append(self.ops.rms_norm_rope_qk(
            qg[..., :head_dim], k, v, self.norms[f"{prefix}.q_norm"], self.norms[f"{prefix}.k_norm"], self.eps,
            cos, sin, kc, vc, length)), count_later=True)
        return q[0], qg[..., head_dim:], lengths

    def attend(self, o_proj, q: torch.Tensor, kv, lengths: torch.Tensor, gate: torch.Tensor, backend: str):
        """``o_proj(decode_attention(q, kv) * sigmoid(gate))``: q ``[B,Hq,S,D]``, gate ``[B,S,Hq,D]`` ->
        ``[B,S,H]`` (or split-K partials, for ``norm``); ``kv`` holds q's S rows (``qk``), not yet
        counted in ``lengths``. With the triton backend the attention's merge counts them (no
        ``length`` add of its own between the two kernels), and with an o_proj that reads its input
        unrotated it also gates: one launch fewer than ``gate_out`` (an H200, 9B shapes, 8 layers in
        a graph: 9.6 against 11.0 us a layer at 2600 filled slots). An int8 ConvRot o_proj also needs
        the rotation: a merge that rotated too, one program per head, measured no faster (12.0
        against 12.0 us, 14.2 against 13.8 at 4 rows), so then: attend, then ``gate_out``. Other
        backends count the rows first."""
        name = resolve_backend(q, q.shape[-1] ** -0.5) if backend == "auto" else backend
        if name != "triton":
            o = decode_attention(q, kv.k, kv.v, kv.count(), causal=True, backend=backend, span=kv.span())
            return self.gate_out(o_proj, o, gate)
        scale, pending = q.shape[-1] ** -0.5, kv.uncounted
        why = ATTENTION_BACKENDS["triton"].reason(q, scale) if backend == "triton" else None
        if why is not None:  # as decode_attention says it
            raise ValueError(f"backend='triton' cannot run: {why}; use backend='auto'")
        attention, _ = triton_module("attention_triton")  # importable: the plan needs Triton
        if self._rotation_of((o_proj,)):
            o = attention.triton_decode_attention(q, kv.k, kv.v, lengths, True, scale, pending=pending)
            kv.counted()
            return self.gate_out(o_proj, o, gate)
        out = attention.triton_decode_attention_gated(q, kv.k, kv.v, lengths, True, scale, gate, pending=pending)
        kv.counted()
        return self.lin(o_proj, out, into_norm=True)

    def gate_out(self, o_proj, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o_proj(o * sigmoid(gate))``: o ``[B,Hq,S,D]``, gate ``[B,S,Hq,D]`` -> ``[B,S,H]`` (or
        split-K partials, for ``norm``); the gate kernel rotates its output for an int8 ConvRot o_proj."""
        group = self._rotation_of((o_proj,))
        if not group:
            return self.lin(o_proj, self.ops.sigmoid_gate(o, gate), into_norm=True)
        out, out_rot = self.ops.sigmoid_gate(o, gate, rotate=group)
        return self.lin(o_proj, out, (group, out_rot), into_norm=True)

    def deltanet(self, i: int, la, xn: torch.Tensor, state, neg_a, dt_bias, key_heads: int,
                 states_out: torch.Tensor, window_out: torch.Tensor) -> torch.Tensor:
        """Fused DeltaNet mixer for S rows; writes per-row states but the last / the conv window
        into the given buffers (the caller stages them; the last row's state goes over
        ``state.recurrent``). xn ``[B,S,H]`` -> ``[B,S,H]`` (or split-K partials, for ``norm``); for
        an int8 ConvRot out_proj the step's gated norm writes its output rotated too."""
        qkv, z, a, b = self.lins((la.in_proj_qkv, la.in_proj_z, la.in_proj_a, la.in_proj_b), xn)
        group = self._rotation_of((la.out_proj,))
        res = self.step.gated_delta_step(
            qkv, z, a, b, state.conv, self.convs[i],
            neg_a, dt_bias, state.recurrent, self.norms[f"layers.{i}.linear_attn.norm"], self.eps,
            key_heads=key_heads, states_out=states_out, window_out=window_out, rotate=group, last_in_place=True)
        return self.lin(la.out_proj, res[0], (group, res[3]) if group else None, into_norm=True)
