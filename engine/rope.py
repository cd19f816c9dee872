"""Partial rotary embeddings with 1-D or 3-axis (MRoPE) positions.

Positions are always handled as ``[3, S]`` (temporal, height, width); text positions repeat the
same index on the three axes, where every MRoPE layout reduces to plain 1-D RoPE. Rotation uses
the rotate-half convention on the first ``rotary_dim`` dims of each head.
"""

from __future__ import annotations

import functools

import torch

from .errors import Qwen35Error


@functools.lru_cache(maxsize=32)
def _axis_of_dim(rotary_dim: int, section: tuple[int, ...], interleaved: bool) -> tuple[int, ...]:
    """Axis (0, 1 or 2) whose position drives each of the ``rotary_dim`` cos/sin columns."""
    half = rotary_dim // 2
    if interleaved:
        # Qwen3-VL / Qwen3.5 layout (transformers, vLLM): frequency j takes H when j % 3 == 1 and
        # j < 3 * section[1], W when j % 3 == 2 and j < 3 * section[2], else T; both halves alike.
        freq_axis = []
        for j in range(half):
            if j % 3 == 1 and j < 3 * section[1]:
                freq_axis.append(1)
            elif j % 3 == 2 and j < 3 * section[2]:
                freq_axis.append(2)
            else:
                freq_axis.append(0)
        return tuple(freq_axis + freq_axis)
    # ComfyUI qwen35.py layout: the duplicated [cos | cos] table is cut into contiguous chunks of
    # 2 * section[i] columns, chunk i driven by axis i % 3 (columns past the sections: axis 0).
    out, col = [], 0
    for i, s in enumerate(section):
        out.extend([i % 3] * (2 * s))
        col += 2 * s
    out = out[:rotary_dim] + [0] * max(0, rotary_dim - len(out))
    return tuple(out)


def normalize_positions(position_ids: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """Positions for ``length`` prompt rows as int64 ``[3, length]`` on ``device``.

    Accepts None (0..length-1), ``[T]``, ``[1, T]``, ``[3, T]`` or ``[3, 1, T]`` (ComfyUI's MRoPE ids;
    floats are rounded).
    """
    if position_ids is None:
        return torch.arange(length, device=device, dtype=torch.int64).expand(3, length).contiguous()
    if not isinstance(position_ids, torch.Tensor):
        position_ids = torch.as_tensor(position_ids)
    p = position_ids
    if p.dim() == 3:
        if p.shape[0] != 3 or p.shape[1] != 1:
            raise Qwen35Error(f"position_ids of shape {tuple(p.shape)}: expected [3, T] or [3, 1, T] "
                              "(batch size 1)")
        p = p[:, 0]
    elif p.dim() == 2 and p.shape[0] == 1:
        p = p.expand(3, -1)
    elif p.dim() == 1:
        p = p.unsqueeze(0).expand(3, -1)
    if p.dim() != 2 or p.shape[0] != 3:
        raise Qwen35Error(f"position_ids of shape {tuple(position_ids.shape)}: expected None, [T], [1, T], "
                          "[3, T] or [3, 1, T]")
    if p.shape[1] != length:
        raise Qwen35Error(f"position_ids cover {p.shape[1]} rows but the prompt has {length}; pass the ids "
                          "made for these embeddings")
    if p.dtype.is_floating_point:
        p = p.round()
    return p.to(device=device, dtype=torch.int64).contiguous()


class RowPositions:
    """Positions of absolute rows: prompt rows use the given ids, later rows continue at max + 1.

    ``rows`` slices one table on the prompt's device (grown by doubling), so a decode step's
    positions cost no kernel launch and no allocation."""

    def __init__(self, prompt: torch.Tensor):
        self.prompt = prompt  # [3, T] int64
        self.length = prompt.shape[1]
        self.offset = int(prompt.max()) + 1 - self.length if self.length else 0
        self._table = prompt

    def rows(self, start: int, count: int) -> torch.Tensor:
        """int64 ``[3, count]`` positions of rows ``start .. start + count - 1`` (a view: not to be
        written to)."""
        end = start + count
        if end > self._table.shape[1]:
            have = self._table.shape[1]
            size = max(end, 2 * have, 64)
            tail = torch.arange(have, size, device=self.prompt.device, dtype=torch.int64) + self.offset
            self._table = torch.cat([self._table, tail.expand(3, -1)], dim=1)
        return self._table[:, start:end]


class Rope:
    """cos/sin tables for one model. ``tables(pos [3,S]) -> (cos, sin)`` float32 ``[S, rotary_dim]``."""

    def __init__(self, rotary_dim: int, theta: float, section, interleaved: bool, device):
        self.rotary_dim = rotary_dim
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta ** exponent)  # [rot/2] float32 (as transformers computes it)
        axis = _axis_of_dim(rotary_dim, tuple(section), bool(interleaved))
        self.axis = torch.tensor(axis, dtype=torch.int64, device=device)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos int64 ``[3, S]`` -> cos, sin float32 ``[S, rotary_dim]``."""
        freqs = pos.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [3, S, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [3, S, rot]
        index = self.axis.view(1, 1, -1).expand(1, emb.shape[1], -1)
        emb = emb.gather(0, index)[0]  # [S, rot]
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot`` dims of x ``[B,H,S,D]`` by cos/sin ``[S, rot]`` (float32 math, x's dtype)."""
    rot = cos.shape[-1]
    xr = x[..., :rot].float()
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)
