"""Length-aware generation cache: fixed-capacity K/V with a device length, DeltaNet state with
exact restore after a partly accepted verify.

Rows are written in two phases so that a speculative verify can keep only a prefix of them:
``write``/``stage`` put S new rows in place (attention over them sees ``length + S`` slots), then
``commit(n)`` keeps the first n (0 <= n <= S). ``rollback(n)`` drops n committed rows of a K/V
cache (the MTP head's drafts). Nothing here ever reads or clears unfilled slots, so allocating a
huge capacity costs no time per token.

DeltaNet restore: the verify forward keeps the recurrent state after every one of its rows
(per-row snapshots), so ``commit(n)`` just picks state n. The fused path writes the state after
its last row over the committed state itself (``staging_buffers`` holds the rows before it): a
step always keeps at least its first row and most often all of them (MTP off: always), which
then costs no copy; ``commit(0)`` of such a step is refused. A deferred-replay alternative (keep the
pre-verify state, recompute the kept rows after acceptance) costs the recurrence again for every
partly accepted step (measured in the tests); snapshots are never slower, so the engine uses them.

The cache owns its bookkeeping: ``ModelCache`` allocates the fused path's staging buffers
(``staging_buffers``), stages every DeltaNet layer at once (``stage_deltanet``, one
``StagedDeltaRows`` record), commits or discards, and saves / restores what a CUDA-graph capture
staged (``save_staged`` / ``drop_staged`` / ``restore_staged``). Nothing outside this module
touches the private fields.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..kernels import bucket_end
from .errors import Qwen35Error

_IN_PLACE_DISCARD = ("commit(0) after a fused step: its last row's DeltaNet state is already written over the "
                     "committed one, so at least its first row must be kept (commit(n), n >= 1)")


class KVCache:
    """K/V of one full-attention layer: ``k``, ``v`` ``[B,Hkv,C,D]``, ``length`` int32 ``[B]`` on the
    device (filled slots, including staged rows) and ``host_length`` (committed slots, int)."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, *, dtype: torch.dtype,
                 device, fill: float | None = None):
        if capacity < 1:
            raise Qwen35Error(f"KV cache capacity must be >= 1, got {capacity}")
        self.k = torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        if fill is not None:
            self.k.fill_(fill)
            self.v.fill_(fill)
        self.length = torch.zeros(batch, dtype=torch.int32, device=device)
        self.host_length = 0
        self.staged = 0
        self.uncounted = 0  # rows staged by write_rows(count_later=True) not yet in ``length``
        self._rows = torch.arange(64, device=device, dtype=torch.int64)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Stage S rows (``[B,Hkv,S,D]``) at the committed length; returns the device ``length``
        (committed + S), ready for ``decode_attention``. Raises Qwen35Error on overflow."""
        if self.staged:
            raise Qwen35Error(f"KVCache.write: {self.staged} staged rows not committed; call commit(n) first")
        s = k_new.shape[2]
        if k_new.shape != v_new.shape or k_new.shape[:2] != self.k.shape[:2] or k_new.shape[3] != self.k.shape[3]:
            raise Qwen35Error(f"KVCache.write: k {tuple(k_new.shape)} / v {tuple(v_new.shape)} do not fit a "
                              f"cache of shape {tuple(self.k.shape)}")
        self._check_room(s)
        if s > self._rows.numel():
            self._rows = torch.arange(s, device=self.k.device, dtype=torch.int64)
        # Slot indices come from the device length, so the write needs no host value (graph friendly).
        idx = self._rows[:s] + self.length[0].to(torch.int64)
        self.k.index_copy_(2, idx, k_new.to(self.k.dtype))
        self.v.index_copy_(2, idx, v_new.to(self.v.dtype))
        self.length.add_(s)
        self.staged = s
        return self.length

    def write_rows(self, s: int, write, *, count_later: bool = False) -> torch.Tensor:
        """``write`` for a kernel that puts the S rows into the cache itself: ``write(k, v, length)``
        stores row j at slot ``length[b] + j`` of ``k``/``v`` (``fused_ops.rms_norm_rope_to_cache``).
        Stages them and returns the device ``length`` (committed + S), as ``write`` does.
        ``count_later``: ``length`` is returned before the S rows are added to it; the caller
        then has a kernel add them (``counted``, the Triton attention's merge) or calls ``count``
        before anything else reads it: one launch fewer in the decode step."""
        if self.staged:
            raise Qwen35Error(f"KVCache.write_rows: {self.staged} staged rows not committed; call commit(n) first")
        self._check_room(s)
        write(self.k, self.v, self.length)
        if not count_later:
            self.length.add_(s)
        self.staged, self.uncounted = s, s if count_later else 0
        return self.length

    def count(self) -> torch.Tensor:
        """Add the rows ``write_rows(count_later=True)`` staged to the device ``length`` (committed + S)."""
        if self.uncounted:
            self.length.add_(self.uncounted)
            self.uncounted = 0
        return self.length

    def counted(self) -> None:
        """A kernel launched after ``write_rows(count_later=True)`` adds the staged rows to ``length``."""
        self.uncounted = 0

    def _check_room(self, s: int) -> None:
        if self.host_length + s > self.capacity:
            raise Qwen35Error(f"KV cache overflow: {self.host_length} filled + {s} new rows > capacity "
                              f"{self.capacity}; allocate the cache for prompt + max_length (+ MTP depth + 1)")

    def commit(self, n: int | None = None) -> None:
        """Keep the first n staged rows (default all) and drop the rest."""
        if self.uncounted:
            raise Qwen35Error(f"KVCache.commit: {self.uncounted} rows staged by write_rows(count_later=True) "
                              "were never counted; call count() (or have a kernel count them) first")
        n = self.staged if n is None else n
        if not 0 <= n <= self.staged:
            raise Qwen35Error(f"KVCache.commit: cannot keep {n} of {self.staged} staged rows")
        if n != self.staged:
            self.length.sub_(self.staged - n)
        self.host_length += n
        self.staged = 0

    def rollback(self, n: int) -> None:
        """Drop the last n committed rows."""
        if self.staged:
            raise Qwen35Error("KVCache.rollback: commit the staged rows first")
        if not 0 <= n <= self.host_length:
            raise Qwen35Error(f"KVCache.rollback: cannot drop {n} of {self.host_length} rows")
        if n:
            self.length.sub_(n)
            self.host_length -= n

    def span(self, rows: int = 0) -> int:
        """The slots the bucketed decode attention reads (``decode_attention(span=)``): the filled
        ones (committed + staged, + ``rows`` about to be staged) rounded up to a bucket
        (``kernels.bucket_end``), a host count."""
        return bucket_end(self.host_length + self.staged + rows, self.capacity)

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled slots (committed + staged): k, v ``[B,Hkv,L,D]``."""
        end = self.host_length + self.staged
        return self.k[:, :, :end], self.v[:, :, :end]


class DeltaNetState:
    """State of one DeltaNet layer: ``recurrent`` float32 ``[B,Hv,Dk,Dv]`` and ``conv`` (the last K-1
    conv inputs, ``[B,conv_dim,K-1]`` in the execution dtype)."""

    def __init__(self, batch: int, value_heads: int, key_head_dim: int, value_head_dim: int, conv_dim: int,
                 kernel: int, *, dtype: torch.dtype, device, recurrent: torch.Tensor | None = None,
                 conv: torch.Tensor | None = None):
        # ``recurrent`` / ``conv`` may be given (zeroed views of a ModelCache's shared buffers).
        self.recurrent = recurrent if recurrent is not None else torch.zeros(
            batch, value_heads, key_head_dim, value_head_dim, dtype=torch.float32, device=device)
        self.conv = conv if conv is not None else torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.kernel = kernel
        self._states: list[torch.Tensor] | None = None
        self._window: torch.Tensor | None = None
        self._rows = 0

    @property
    def staged(self) -> int:
        return self._rows

    def stage(self, states: list[torch.Tensor], window: torch.Tensor, rows: int) -> None:
        """Record the outcome of ``rows`` new rows without applying it.

        ``states``: the recurrent state after each row (``len == rows``), or only the final one
        (``len == 1``; then only ``commit(rows)`` or ``commit(0)`` are possible). ``window``: the conv
        inputs ``[B,conv_dim,K-1+rows]`` (old window followed by the new rows). With only the final
        state, only the window's last K-1 columns are kept (a copy: a long prompt's whole window is
        not held until the commit). A last state that is ``recurrent`` itself was written over it
        in place (the fused step), so ``commit(0)`` is refused.
        """
        if self._rows:
            raise Qwen35Error(f"DeltaNetState.stage: {self._rows} staged rows not committed")
        if len(states) not in (1, rows) or window.shape[-1] != self.kernel - 1 + rows:
            raise Qwen35Error(f"DeltaNetState.stage: {len(states)} states / window of {window.shape[-1]} "
                              f"columns do not describe {rows} rows")
        if len(states) == 1 and rows > 1:
            window = window[..., rows:].clone()
        self._states, self._window, self._rows = states, window, rows

    def commit(self, n: int | None = None) -> None:
        """Apply the first n staged rows (default all); n = 0 discards them."""
        rows = self._rows
        n = rows if n is None else n
        if not 0 <= n <= rows:
            raise Qwen35Error(f"DeltaNetState.commit: cannot keep {n} of {rows} staged rows")
        if rows and not n and self._states[-1] is self.recurrent:
            raise Qwen35Error(_IN_PLACE_DISCARD)
        if n:
            if len(self._states) == rows:
                state = self._states[n - 1]
            elif n == rows:
                state = self._states[-1]
            else:
                raise Qwen35Error(f"DeltaNetState.commit: only the final state of {rows} rows was kept, "
                                  f"so {n} rows cannot be committed")
            if state is not self.recurrent:
                self.recurrent.copy_(state)
            start = n - (self.kernel - 1 + rows - self._window.shape[-1])  # a kept tail starts at column rows
            self.conv.copy_(self._window[..., start:start + self.kernel - 1])
        self._states, self._window, self._rows = None, None, 0

    def _saved(self) -> tuple:
        return self._states, self._window, self._rows

    def _put(self, saved: tuple) -> None:
        self._states, self._window, self._rows = saved


@dataclass
class StagedDeltaRows:
    """What ``ModelCache.stage_deltanet`` staged for every DeltaNet layer at once.

    ``states`` float32 ``[n_delta,S-1,B,Hv,Dk,Dv]`` (the state after each row but the last, which
    the step wrote over ``ModelCache.recurrent``), ``windows``
    ``[n_delta,B,C,K-1+S]`` (conv inputs), ``rows`` = S, and ``views``: the per-layer views handed
    to each ``DeltaNetState.stage`` (if a layer was restaged since, the record no longer applies).
    """

    states: torch.Tensor
    windows: torch.Tensor
    rows: int
    views: list


class ModelCache:
    """Everything a Qwen3.5 generation keeps between steps.

    ``layers[i]`` is a ``KVCache`` (full attention) or a ``DeltaNetState`` (linear attention);
    ``mtp`` is the MTP layer's ``KVCache`` or None. ``config`` needs the fields of
    ``engine.Qwen35Config``. ``fill`` writes a value into every K/V slot first (NaN to prove that
    unfilled slots are never read; 0 for the capacity-bound "masked" baseline).
    """

    def __init__(self, config, *, batch: int, capacity: int, dtype: torch.dtype, device, mtp: bool = False,
                 fill: float | None = None):
        c = config
        self.capacity = capacity

        def kv():
            return KVCache(batch, c.num_key_value_heads, capacity, c.head_dim, dtype=dtype, device=device, fill=fill)

        conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim
                    + c.linear_num_value_heads * c.linear_value_head_dim)
        n_delta = sum(kind != "full_attention" for kind in c.layer_types)
        self.kernel = c.conv_kernel_size
        # All DeltaNet layers' states in two shared buffers, so that committing a fused forward's
        # staged rows is one copy each (``stage_group``), not two per layer.
        self.recurrent = torch.zeros(n_delta, batch, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_delta, batch, conv_dim, c.conv_kernel_size - 1, dtype=dtype, device=device)
        self.layers: list[KVCache | DeltaNetState] = []
        j = 0
        for kind in c.layer_types:
            if kind == "full_attention":
                self.layers.append(kv())
            else:
                self.layers.append(DeltaNetState(
                    batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, conv_dim,
                    c.conv_kernel_size, dtype=dtype, device=device, recurrent=self.recurrent[j], conv=self.conv[j]))
                j += 1
        self.mtp = kv() if mtp else None
        self._first_kv = next(x for x in self.layers if isinstance(x, KVCache))
        self._staged_delta: StagedDeltaRows | None = None

    # ------------------------------------------------------------------ staging
    def staging_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty buffers for ``rows`` rows of every DeltaNet layer, for ``stage_deltanet``: states
        float32 ``[n_delta,S-1,B,Hv,Dk,Dv]`` (every row's but the last: the step writes that one
        over ``recurrent``, ``gated_delta_step(last_in_place=True)``) and conv windows
        ``[n_delta,B,C,K-1+S]``."""
        b, conv_dim, k1 = self.conv.shape[1:]
        states = torch.empty(self.recurrent.shape[0], rows - 1, *self.recurrent.shape[1:], dtype=torch.float32,
                             device=self.recurrent.device)
        windows = torch.empty(self.conv.shape[0], b, conv_dim, k1 + rows, dtype=self.conv.dtype,
                              device=self.conv.device)
        return states, windows

    def stage_deltanet(self, states: torch.Tensor, windows: torch.Tensor, rows: int) -> None:
        """Stage ``rows`` rows of every DeltaNet layer at once (buffers from ``staging_buffers``,
        filled); ``commit`` then applies them with one copy for all layers."""
        deltas = self.delta_states()
        for j, st in enumerate(deltas):
            st.stage(list(states[j].unbind(0)) + [st.recurrent], windows[j], rows)  # the last one in place
        self._staged_delta = StagedDeltaRows(states, windows, rows, [st._states for st in deltas])

    @property
    def length(self) -> int:
        """Committed rows of the main model."""
        return self._first_kv.host_length

    def commit(self, n: int | None = None) -> None:
        """Keep the first n staged rows in every main layer (default all)."""
        staged, self._staged_delta = self._staged_delta, None
        deltas = self.delta_states()
        if staged is not None and all(st._states is view for st, view in zip(deltas, staged.views)):
            states, windows, rows = staged.states, staged.windows, staged.rows
            n = rows if n is None else n
            if not 0 <= n <= rows:
                self._staged_delta = staged
                raise Qwen35Error(f"DeltaNetState.commit: cannot keep {n} of {rows} staged rows")
            if not n:
                self._staged_delta = staged
                raise Qwen35Error(_IN_PLACE_DISCARD)
            if n < rows:  # the last row's state is in place already; an earlier one is one copy
                self.recurrent.copy_(states[:, n - 1])
            self.conv.copy_(windows[..., n:n + self.kernel - 1])  # one copy for all layers' windows
            for st in deltas:
                st._put((None, None, 0))
        for layer in self.layers:
            if isinstance(layer, KVCache) or layer.staged:
                layer.commit(n)

    def reset(self) -> None:
        """Empty the cache for a new generation: no rows, zero DeltaNet state (slots are not cleared)."""
        self._staged_delta = None
        self.recurrent.zero_()
        self.conv.zero_()
        for st in self.layers + [self.mtp]:
            if isinstance(st, KVCache):
                st.length.zero_()
                st.host_length = st.staged = st.uncounted = 0
            elif st is not None:
                st._put((None, None, 0))

    def discard(self) -> None:
        """Drop every staged row of the main model (``commit(0)``; refused after a fused step,
        whose last row's DeltaNet state is already in place)."""
        self.commit(0)

    @contextlib.contextmanager
    def scratch_step(self, part: str):
        """A step run only for its side effects on the GPU (a CUDA-graph warm-up): afterwards the
        staged rows and device lengths are forgotten and the DeltaNet state the fused step wrote
        in place is put back (one copy of ``recurrent`` held meanwhile)."""
        saved = self.recurrent.clone() if part == "main" else None
        try:
            yield
        finally:
            self.drop_staged(part, lengths_moved=True)
            if saved is not None:
                self.recurrent.copy_(saved)

    # ------------------------------------------------------------------ CUDA-graph support
    def _part(self, part: str) -> list:
        if part not in ("main", "mtp"):
            raise Qwen35Error(f"cache part must be 'main' or 'mtp', got {part!r}")
        return [self.mtp] if part == "mtp" else self.layers

    def check_room(self, part: str, rows: int) -> None:
        """Qwen35Error unless ``rows`` new rows can be staged in ``part`` ("main" or "mtp") now."""
        for st in self._part(part):
            if st.staged:
                raise Qwen35Error("graph step: staged rows not committed; call commit(n) first")
            if isinstance(st, KVCache) and st.host_length + rows > st.capacity:
                raise Qwen35Error(f"KV cache overflow: {st.host_length} filled + {rows} new rows > capacity "
                                  f"{st.capacity}; allocate the cache for prompt + max_length (+ MTP depth + 1)")

    def span(self, part: str, rows: int) -> int:
        """``KVCache.span`` of ``part`` ("main" or "mtp") once ``rows`` more rows are staged there."""
        return (self._part(part)[0] if part == "mtp" else self._first_kv).span(rows)

    def save_staged(self, part: str) -> tuple:
        """What a forward over ``part`` staged (host side), for ``restore_staged`` after a replay."""
        saved = [st._saved() if isinstance(st, DeltaNetState) else st.staged for st in self._part(part)]
        return part, saved, (self._staged_delta if part == "main" else None)

    def drop_staged(self, part: str, *, lengths_moved: bool) -> None:
        """Forget what a warm-up (``lengths_moved``: it advanced the device lengths) or a capture
        (recorded only: the device lengths did not move) staged in ``part``; committed state stays."""
        if part == "main":
            self._staged_delta = None
        for st in self._part(part):
            if isinstance(st, DeltaNetState):
                st._put((None, None, 0))
            elif st.staged:
                if lengths_moved and st.staged > st.uncounted:
                    st.length.sub_(st.staged - st.uncounted)
                st.staged = st.uncounted = 0

    def restore_staged(self, saved: tuple) -> None:
        """Re-apply ``save_staged``'s record: a graph replay staged the same rows on the device."""
        part, states, delta = saved
        if part == "main":
            self._staged_delta = delta
        for st, value in zip(self._part(part), states):
            if isinstance(st, DeltaNetState):
                st._put(value)
            else:
                st.staged = value

    def delta_states(self) -> list[DeltaNetState]:
        return [x for x in self.layers if isinstance(x, DeltaNetState)]
