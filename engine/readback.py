"""Device values on their way to the host, read later: the host launches more work meanwhile."""

from __future__ import annotations

import torch


class Readback:
    """int64 values ``[N]`` on the device, copied behind the work that produced them.

    On CUDA the copy goes into the given pinned buffer (at least N entries) and an event marks its
    end, so the host may launch more work before it reads (``values`` waits for the copy only, not
    for what was launched after it); elsewhere (``pinned`` None) the values are cloned now (a
    later step may write over the tensor) and read when asked.
    """

    def __init__(self, values: torch.Tensor, pinned: torch.Tensor | None):
        self.event = None
        self.n = values.numel()
        if pinned is None:
            self.buf = values.reshape(-1).clone()
            return
        if pinned.numel() < self.n:
            raise ValueError(f"Readback: a pinned buffer of {pinned.numel()} entries cannot take {self.n} values")
        self.buf = pinned[:self.n]
        self.buf.copy_(values.reshape(-1), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def values(self) -> list[int]:
        """The N values (waits for their copy on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()

    def value(self) -> int:
        """The first value (waits for the copy on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return int(self.buf[0])
