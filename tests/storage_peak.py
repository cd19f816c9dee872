"""Peak bytes of the tensor storages a piece of code creates (any device, CPU in CI).

``StoragePeak`` is a dispatch mode: every storage an op returns that was not alive before is
counted from its creation until the storage is freed (a weak reference's finalizer), views
included (a view keeps its storage alive, and so its bytes). ``peak`` is the most bytes alive at
once. Storages made before the mode (the inputs) count only when an op inside returns a view of
them first, so compare runs that see the same inputs.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StoragePeak(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._alive.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in self._alive:
                continue
            self._alive.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, key, nbytes)
        return out
