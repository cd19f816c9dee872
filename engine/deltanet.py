"""Gated delta rule: the recurrence of a Qwen3.5 DeltaNet layer, row by row or chunked.

Per value head, with state ``S`` ``[Dk, Dv]`` (float32), decay ``a_t = exp(g_t)``, and unit-norm
``k_t``, scaled unit-norm ``q_t``::

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

``recurrent_rows`` applies it one row at a time and keeps the state after every row (what an MTP
verify needs to restore the state at any accepted count). ``chunked_rows`` computes the same thing
for a long prompt in chunks of 64 rows (WY form, triangular solves), returning only the final
state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The L2 norm's epsilon: ``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / transformers convention).
L2_EPS = 1e-6


def gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """Log-decay and write strength. a, b ``[B,S,Hv]`` -> g, beta float32 ``[B,S,Hv]``.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` with ``neg_a = -exp(A_log)`` float32 ``[Hv]``;
    ``beta = sigmoid(b)``.
    """
    g = neg_a * F.softplus(torch.add(a, dt_bias))  # a's dtype promoted to float32 by the add
    return g, torch.sigmoid(b.float())


def prepare_qk(qk: torch.Tensor, value_heads: int):
    """qk ``[B,S,2,Hk,Dk]`` (q then k, any float dtype) -> float32 q (L2-normed, scaled by
    ``Dk^-0.5``) and k (L2-normed), both ``[B,S,Hv,Dk]`` with value head h reading key head
    ``h // (Hv/Hk)``: views of one new tensor, made in seven launches whatever the head counts."""
    b, s, _, hk, dk = qk.shape
    rep = value_heads // hk
    x = qk.float()
    r = torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)
    r[:, :, 0].mul_(dk ** -0.5)
    y = torch.empty(b, s, 2, hk, rep, dk, dtype=torch.float32, device=x.device)
    torch.mul(x.unsqueeze(4).expand(b, s, 2, hk, rep, dk), r.unsqueeze(4), out=y)
    y = y.view(b, s, 2, hk * rep, dk)
    return y[:, :, 0], y[:, :, 1]


def prepare_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value_heads: int):
    """q, k ``[B,S,Hk,Dk]``, v ``[B,S,Hv,Dv]`` -> ``prepare_qk``'s q and k, and v in float32."""
    q, k = prepare_qk(torch.stack([q, k], dim=2), value_heads)
    return q, k, v.float()


def recurrent_rows(state: torch.Tensor, q, k, v, g, beta):
    """Row-by-row gated delta rule, keeping every intermediate state.

    state float32 ``[B,Hv,Dk,Dv]`` (not modified); q, k ``[B,S,Hv,Dk]``, v ``[B,S,Hv,Dv]``, g, beta
    ``[B,S,Hv]`` (all float32, q/k prepared by ``prepare_qkv``). Returns ``(out [B,S,Hv,Dv],
    states)`` with ``states[j]`` the state after row j (new tensors).
    """
    outs, states = [], []
    s = state
    decay = g.exp()
    for j in range(q.shape[1]):
        s = s * decay[:, j, :, None, None]
        kj = k[:, j]
        mem = torch.einsum("bhk,bhkv->bhv", kj, s)
        delta = (v[:, j] - mem) * beta[:, j, :, None]
        s = torch.addcmul(s, kj.unsqueeze(-1), delta.unsqueeze(-2))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, j], s))
        states.append(s)
    return (outs[0].unsqueeze(1) if len(outs) == 1 else torch.stack(outs, dim=1)), states


def chunked_rows(state: torch.Tensor, q, k, v, g, beta, chunk: int = 64):
    """Chunked gated delta rule over many rows (same math as ``recurrent_rows``).

    Same inputs; returns ``(out [B,S,Hv,Dv] float32, final_state [B,Hv,Dk,Dv] float32)``.
    Within a chunk with cumulative log-decay ``G``: ``(I + L) U = beta*v - (beta*k*e^G) S0`` with
    ``L[t,s] = beta_t (k_t.k_s) e^(G_t-G_s)`` for s < t, then ``O = (q e^G) S0 + (q k^T * D) U``
    with ``D[t,s] = e^(G_t-G_s)`` for s <= t, and ``S = e^(G_last) S0 + (k e^(G_last-G))^T U``.
    Every chunk's terms are computed at once; the only sequential part is the state entering each
    chunk, one batched multiply-add per chunk (``S = A S0 + B``), so a prompt costs a fixed ~50
    launches per layer plus one per 64 rows.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    # [B,S,H,*] -> [B,H,N,C,*]; padded rows have k = v = q = 0, g = 0, beta = 0: no effect.
    def split(x, last):
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if last else (0, pad))
        n = x.shape[2] // chunk
        return x.reshape(b, h, n, chunk, -1) if last else x.reshape(b, h, n, chunk)

    qc, kc, vc = split(q, True), split(k, True), split(v, True)
    gc, bc = split(g, False), split(beta, False)
    n = qc.shape[2]
    # Each temporary is dropped (or overwritten in place) once read: they are [B,H,N,C,*] float32,
    # a few times the size of q, and a long prompt's prefill holds them all layer by layer.
    gcum = gc.cumsum(dim=-1)  # [B,H,N,C]
    lower_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gcum.unsqueeze(-1) - gcum.unsqueeze(-2)).masked_fill_(~lower_incl, float("-inf")).exp_()
    del gc, lower_incl  # decay: D[t,s] = e^(G_t - G_s), zero above the diagonal
    kb = kc * bc.unsqueeze(-1)
    # I + L: the solve reads only the strict lower part (unitriangular), so L = (kb k^T) * D as is.
    system = (kb @ kc.transpose(-1, -2)).mul_(decay)
    # One solve for both right-hand sides: sol = [U_base | W], (I + L) sol = [beta*v | beta*k*e^G].
    exp_g = gcum.exp().unsqueeze(-1)  # e^G [B,H,N,C,1]
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * exp_g], dim=-1)
    del vc, bc, kb
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B,H,N,C,Dv+Dk]
    del system, rhs
    qk = (qc @ kc.transpose(-1, -2)).mul_(decay)
    del decay
    k_tail = (kc * (gcum[..., -1:] - gcum).exp().unsqueeze(-1)).transpose(-1, -2)  # [B,H,N,Dk,C]
    del kc
    # With U = U_base - W S0: O = (q e^G - qk W) S0 + qk U_base and S = A S0 + B, where
    # A = e^(G_last) I - k_tail^T W and B = k_tail^T U_base. All chunks' A, B, O-terms at once;
    # only S0 of each chunk is sequential (one batched multiply-add per chunk).
    qk_sol = qk @ sol
    del qk
    b_mat = k_tail @ sol[..., :dv]  # [B,H,N,Dk,Dv]
    a_mat = (k_tail @ sol[..., dv:]).neg_()  # [B,H,N,Dk,Dk]
    a_mat.diagonal(dim1=-2, dim2=-1).add_(gcum[..., -1:].exp())
    del k_tail, sol
    p_mat = (qc * exp_g).sub_(qk_sol[..., dv:])
    del qc, exp_g
    a_seq = a_mat.flatten(0, 1).transpose(0, 1)  # [N, B*H, Dk, Dk] (views)
    b_seq = b_mat.flatten(0, 1).transpose(0, 1)  # [N, B*H, Dk, Dv]
    # starts[i]: the state entering chunk i, [N, B*H, Dk, Dv] so each is contiguous.
    starts = torch.empty(n, b * h, dk, dv, dtype=q.dtype, device=q.device)
    starts[0] = state.reshape(b * h, dk, dv)
    starts[1:] = b_seq[:-1]
    for i in range(n - 1):  # in place: one batched GEMM (beta = 1) per chunk
        starts[i + 1].baddbmm_(a_seq[i], starts[i])
    s = torch.baddbmm(b_seq[-1], a_seq[-1], starts[-1]).view(b, h, dk, dv)
    del a_mat, b_mat, a_seq, b_seq
    out = (p_mat @ starts.view(n, b, h, dk, dv).permute(1, 2, 0, 3, 4)).add_(qk_sol[..., :dv])  # [B,H,N,C,Dv]
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t].transpose(1, 2)
    return out, s
