"""Full-recompute Qwen3.5 reference for tests (float64, no cache, one token at a time where it matters).

Written from the model definition, independent of the engine: explicit RMSNorm with ``(1 + w)``,
per-token causal conv and delta-rule recurrence, causal softmax attention over all positions,
partial rotary embedding with the interleaved MRoPE layout. Reads a canonical state dict
(``embed_tokens.weight``, ``layers.N.*``, ``norm.weight``, optional ``lm_head.weight``, ``mtp.*``).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


class Reference:
    """The model of a canonical state dict ``sd`` with dims ``d`` (``tests.oracles.tiny`` format)."""

    def __init__(self, sd: dict[str, torch.Tensor], d: dict, *, eps: float = 1e-6, theta: float = 1e7,
                 rotary_factor: float = 0.25, section=(11, 11, 10)):
        self.w = {k: v.to(F64) for k, v in sd.items()}
        self.d = d
        self.eps = eps
        self.theta = theta
        self.rot = int(d["head_dim"] * rotary_factor)
        self.section = section

    # ------------------------------------------------------------------ pieces
    def rms(self, x, w, add=True):
        scale = (1.0 + w) if add else w
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * scale

    def embed(self, tokens) -> torch.Tensor:
        return self.w["embed_tokens.weight"][torch.as_tensor(tokens, dtype=torch.long)]

    def lm_head(self, h):
        return h @ self.w.get("lm_head.weight", self.w["embed_tokens.weight"]).T

    def angles(self, pos: torch.Tensor) -> torch.Tensor:
        """pos int ``[3,T]`` -> rotation angles ``[T, rot/2]`` (interleaved MRoPE: frequency j uses
        the H position when j % 3 == 1 and j < 3*section[1], W when j % 3 == 2 and j < 3*section[2])."""
        half = self.rot // 2
        inv = torch.tensor([1.0 / self.theta ** (2 * j / self.rot) for j in range(half)], dtype=F64)
        axis = [1 if (j % 3 == 1 and j < 3 * self.section[1]) else 2 if (j % 3 == 2 and j < 3 * self.section[2])
                else 0 for j in range(half)]
        p = pos.to(F64)
        return torch.stack([p[axis[j]] * inv[j] for j in range(half)], dim=-1)

    def rotate(self, x, ang):
        """x ``[T, heads, D]``: rotate pairs (i, i + rot/2) of the first rot dims by ``ang [T, rot/2]``."""
        half = self.rot // 2
        c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:self.rot]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., self.rot:]], dim=-1)

    def mlp(self, p, x):
        gate = x @ self.w[p + "mlp.gate_proj.weight"].T
        up = x @ self.w[p + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T

    def attention(self, p, x, ang):
        d = self.d
        t = x.shape[0]
        hd, hq, hkv = d["head_dim"], d["num_attention_heads"], d["num_key_value_heads"]
        qg = (x @ self.w[p + "q_proj.weight"].T).view(t, hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, hq * hd)
        k = (x @ self.w[p + "k_proj.weight"].T).view(t, hkv, hd)
        v = (x @ self.w[p + "v_proj.weight"].T).view(t, hkv, hd)
        q = self.rotate(self.rms(q, self.w[p + "q_norm.weight"]), ang)
        k = self.rotate(self.rms(k, self.w[p + "k_norm.weight"]), ang)
        group = hq // hkv
        kh = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kh) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vh)
        out = out.reshape(t, hq * hd) * torch.sigmoid(gate)
        return out @ self.w[p + "o_proj.weight"].T

    def deltanet(self, p, x):
        """Returns (output [T,H], final recurrent state [Hv,Dk,Dv], final conv window [C, K-1])."""
        d = self.d
        t = x.shape[0]
        hk, hv = d["linear_num_key_heads"], d["linear_num_value_heads"]
        dk, dv = d["linear_key_head_dim"], d["linear_value_head_dim"]
        kern = d["conv_kernel_size"]
        mixed_in = x @ self.w[p + "in_proj_qkv.weight"].T  # [T, C]
        z = (x @ self.w[p + "in_proj_z.weight"].T).view(t, hv, dv)
        beta = torch.sigmoid(x @ self.w[p + "in_proj_b.weight"].T)
        a = x @ self.w[p + "in_proj_a.weight"].T
        g = -torch.exp(self.w[p + "A_log"]) * torch.nn.functional.softplus(a + self.w[p + "dt_bias"])
        conv_w = self.w[p + "conv1d.weight"][:, 0, :]  # [C, K]
        padded = torch.cat([torch.zeros(kern - 1, mixed_in.shape[1], dtype=F64), mixed_in], dim=0)
        # causal depthwise conv: output t = sum_m w[:, m] * input[t - K + 1 + m]
        conv = sum(padded[m:m + t] * conv_w[:, m] for m in range(kern))
        mixed_all = torch.nn.functional.silu(conv)  # [T, C]
        state = torch.zeros(hv, dk, dv, dtype=F64)
        outs = []
        rep = hv // hk
        for i in range(t):
            mixed = mixed_all[i]
            q = mixed[:hk * dk].view(hk, dk).repeat_interleave(rep, 0)
            k = mixed[hk * dk:2 * hk * dk].view(hk, dk).repeat_interleave(rep, 0)
            v = mixed[2 * hk * dk:].view(hv, dv)
            q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(dk)
            k = k / k.norm(dim=-1, keepdim=True)
            # per head h: S = S e^g; u = beta (v - S^T k); S += k u^T; o = S^T q
            state = state * torch.exp(g[i])[:, None, None]
            u = beta[i][:, None] * (v - torch.einsum("hkv,hk->hv", state, k))
            state = state + k[:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", state, q))
        o = torch.stack(outs)  # [T, Hv, Dv]
        o = self.rms(o, self.w[p + "norm.weight"], add=False) * torch.nn.functional.silu(z)
        conv_tail = padded[-(kern - 1):].T.contiguous()
        return o.reshape(t, hv * dv) @ self.w[p + "out_proj.weight"].T, state, conv_tail

    # ------------------------------------------------------------------ model
    def forward(self, embeds: torch.Tensor, pos: torch.Tensor | None = None):
        """embeds ``[T,H]``, pos ``[3,T]`` (default 0..T-1) -> dict(logits [T,V], hidden (normed) [T,H],
        prenorm [T,H], states {layer: (recurrent, conv)})."""
        x = embeds.to(F64)
        t = x.shape[0]
        if pos is None:
            pos = torch.arange(t).expand(3, t)
        ang = self.angles(pos)
        states = {}
        for i, kind in enumerate(self.d["layer_types"]):
            p = f"layers.{i}."
            xn = self.rms(x, self.w[p + "input_layernorm.weight"])
            if kind == "linear_attention":
                mixed, rec, conv = self.deltanet(p + "linear_attn.", xn)
                states[i] = (rec, conv)
            else:
                mixed = self.attention(p + "self_attn.", xn, ang)
            x = x + mixed
            x = x + self.mlp(p, self.rms(x, self.w[p + "post_attention_layernorm.weight"]))
        hidden = self.rms(x, self.w["norm.weight"])
        return dict(logits=self.lm_head(hidden), hidden=hidden, prenorm=x, states=states)

    def mtp(self, hidden: torch.Tensor, next_embeds: torch.Tensor, pos: torch.Tensor | None = None):
        """MTP head over rows t: (hidden_t, embedding of token t+1) -> (normed out [T,H], logits [T,V])."""
        t = hidden.shape[0]
        if pos is None:
            pos = torch.arange(t).expand(3, t)
        e = self.rms(next_embeds.to(F64), self.w["mtp.pre_fc_norm_embedding.weight"])
        h = self.rms(hidden.to(F64), self.w["mtp.pre_fc_norm_hidden.weight"])
        x = torch.cat([e, h], dim=-1) @ self.w["mtp.fc.weight"].T
        p = "mtp.layers.0."
        x = x + self.attention(p + "self_attn.", self.rms(x, self.w[p + "input_layernorm.weight"]), self.angles(pos))
        x = x + self.mlp(p, self.rms(x, self.w[p + "post_attention_layernorm.weight"]))
        out = self.rms(x, self.w["mtp.norm.weight"])
        return out, self.lm_head(out)

    def greedy(self, prompt: torch.Tensor, n: int, stop=()) -> list[int]:
        """Greedy tokens by full recompute of the whole sequence at every step (1-D positions)."""
        seq = prompt.to(F64)
        out: list[int] = []
        for _ in range(n):
            logits = self.forward(seq)["logits"][-1]
            tok = int(logits.argmax())
            out.append(tok)
            if tok in stop:
                break
            seq = torch.cat([seq, self.embed([tok])], dim=0)
        return out
