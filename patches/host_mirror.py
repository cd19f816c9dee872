"""The page-locked host home of one ComfyUI model's weights: moves between host and GPU at the bus's speed.

``HostMirror`` keeps, for each leaf tensor of a model (every parameter and buffer; for a wrapper tensor
such as comfy-kitchen's ``QuantizedTensor``, every inner tensor its ``__tensor_flatten__`` names), a
*slot*: a view of the same shape and dtype into page-locked host chunks that ComfyUI's own
``pin_memory`` registered (its ``MAX_PINNED_MEMORY`` and ``--disable-pinned-memory`` apply; ``release``
hands them back through ``unpin_memory``).

Contract of a slot: once filled it holds the leaf's *unpatched* value. ComfyUI restores a patched
weight (LoRA, hooks) from its backup before it moves the weight to the offload device, so what it
offloads is always the unpatched value; the mirror relies on that and on nothing writing the weights
in place on the GPU.

``move(key, tensor, device)`` returns the leaf on ``device`` (``key`` names the leaf in the model):

* host -> GPU: a new device tensor filled from the slot by one asynchronous copy. A host leaf that is
  not the slot's own view is first copied into the slot (the slot then replaces it: one host copy).
* GPU -> host: the slot's view, with no copy, when the device tensor is the one this mirror made from
  the slot; otherwise one asynchronous copy into the slot.

A leaf with no slot (the pinned budget ran out, a non-contiguous leaf) moves as torch moves it. Every
copy is asynchronous on the current stream: the caller synchronizes once after a batch of moves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

#: Bytes of one pinned chunk (a leaf larger than this gets a chunk of its own).
CHUNK_BYTES = 256 << 20
#: Byte alignment of every slot inside its chunk.
ALIGN = 512


def wrapper_inner(t: torch.Tensor) -> list[str] | None:
    """The inner tensor names of a traceable wrapper subclass (``__tensor_flatten__``), else None."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return None
    return list(t.__tensor_flatten__()[0])


def leaves(key: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(leaf key, leaf tensor)`` of one parameter or buffer: itself, or each inner tensor of a
    wrapper (``<key>/<inner name>``, recursively)."""
    inner = wrapper_inner(t)
    if inner is None:
        yield key, t
        return
    for name in inner:
        yield from leaves(f"{key}/{name}", getattr(t, name))


def tensor_keys(module: torch.nn.Module, prefix: str = "") -> dict[int, str]:
    """``id(parameter or buffer) -> <module path>:<name>`` over ``module`` and its submodules
    (``prefix``: ``module``'s path in the model), each tensor under the first path that holds it."""
    keys: dict[int, str] = {}
    for path, sub in module.named_modules():
        full = f"{prefix}.{path}" if prefix and path else (prefix or path)
        for group in (sub._parameters, sub._buffers):
            for name, t in group.items():
                if t is not None:
                    keys.setdefault(id(t), f"{full}:{name}")
    return keys


def model_leaves(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every leaf of ``model`` once: ``<module path>:<parameter or buffer name>[/<inner>...]``."""
    tensors = {id(t): t for _path, sub in model.named_modules()
               for group in (sub._parameters, sub._buffers) for t in group.values() if t is not None}
    for tid, key in tensor_keys(model).items():
        yield from leaves(key, tensors[tid])


@dataclass
class MoveCount:
    """Bytes a batch of moves copied each way, and the bytes it moved without a copy."""
    to_device: int = 0
    to_host: int = 0
    kept: int = 0
    unmirrored: int = 0


@dataclass
class HostMirror:
    """Pinned slots for the leaves of one model (see the module docstring). ``pinned_bytes``: what the
    chunks hold registered with ComfyUI; ``missing``: leaf keys without a slot, and why."""
    slots: dict[str, torch.Tensor] = field(default_factory=dict)
    chunks: list[torch.Tensor] = field(default_factory=list)
    pinned_bytes: int = 0
    missing: dict[str, str] = field(default_factory=dict)
    made: dict[str, int] = field(default_factory=dict)  # leaf key -> data_ptr of the device copy made from its slot
    alias: dict[str, str] = field(default_factory=dict)  # a tied tensor's other keys -> its key
    count: MoveCount = field(default_factory=MoveCount)

    @classmethod
    def build(cls, model: torch.nn.Module, pin: Callable[[torch.Tensor], bool],
              budget: int) -> HostMirror:
        """Slots for ``model``'s leaves, in module order, in chunks of ``CHUNK_BYTES`` that ``pin``
        (ComfyUI's ``pin_memory``) registered, at most ``budget`` bytes; leaves past a refusal or the
        budget get none (``missing``). Host leaves are copied into their slots and replaced by them
        (``rebind_host``); device leaves are copied in when they are first moved to the host."""
        mirror = cls()
        first: dict[int, str] = {}
        for path, sub in model.named_modules():
            for group in (sub._parameters, sub._buffers):
                for name, t in group.items():
                    if t is not None and first.setdefault(id(t), f"{path}:{name}") != f"{path}:{name}":
                        mirror.alias[f"{path}:{name}"] = first[id(t)]
        plan, size, current = [], 0, []
        for key, t in model_leaves(model):
            if not t.is_contiguous() or t.numel() == 0:
                mirror.missing[key] = "not contiguous" if t.numel() else "empty"
                continue
            n = _aligned(t.numel() * t.element_size())
            if current and size + n > CHUNK_BYTES:
                plan.append((current, size))
                current, size = [], 0
            current.append((key, t, size))
            size += n
        if current:
            plan.append((current, size))
        for members, nbytes in plan:
            why = None
            if mirror.pinned_bytes + nbytes > budget:
                why = "the pinned-memory budget is spent"
            else:
                chunk = torch.empty(nbytes, dtype=torch.uint8)
                if pin(chunk):
                    mirror.chunks.append(chunk)
                    mirror.pinned_bytes += nbytes
                    for key, t, offset in members:
                        n = t.numel() * t.element_size()
                        mirror.slots[key] = chunk[offset:offset + n].view(t.dtype).view(t.shape)
                    continue
                why = "ComfyUI refused to pin more host memory"
            for key, _t, _offset in members:
                mirror.missing[key] = why
        return mirror

    def release(self, unpin: Callable[[torch.Tensor], bool]) -> None:
        """Hand every chunk back to ComfyUI (``unpin_memory``) and forget the slots."""
        for chunk in self.chunks:
            unpin(chunk)
        self.chunks.clear()
        self.slots.clear()
        self.made.clear()
        self.pinned_bytes = 0

    def move(self, key: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (the leaf ``key``, or a parameter / buffer whose leaves are under ``key``) on ``device``."""
        key = self.alias.get(key, key)
        inner = wrapper_inner(t)
        if inner is not None:
            names, ctx = t.__tensor_flatten__()
            moved = {name: self.move(f"{key}/{name}", getattr(t, name), device) for name in names}
            if all(moved[n] is getattr(t, n) for n in names):
                return t
            return type(t).__tensor_unflatten__(moved, ctx, t.size(), t.stride())
        if t.device == device:
            return t
        slot = self.slots.get(key)
        nbytes = t.numel() * t.element_size()
        if slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
            self.count.unmirrored += nbytes
            return t.to(device)
        if device.type == "cpu":
            if self.made.pop(key, None) == t.data_ptr():
                self.count.kept += nbytes
            else:
                slot.copy_(t, non_blocking=True)
                self.count.to_host += nbytes
            return slot
        if t.device.type == "cpu" and t.data_ptr() != slot.data_ptr():
            slot.copy_(t)
        out = torch.empty_like(slot, device=device)
        out.copy_(slot, non_blocking=True)
        self.made[key] = out.data_ptr()
        self.count.to_device += nbytes
        return out

    def host_view(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host leaf replaced by its slot (its value copied in first), else ``t`` unchanged."""
        key = self.alias.get(key, key)
        inner = wrapper_inner(t)
        if inner is not None:
            names, ctx = t.__tensor_flatten__()
            viewed = {name: self.host_view(f"{key}/{name}", getattr(t, name)) for name in names}
            if all(viewed[n] is getattr(t, n) for n in names):
                return t
            return type(t).__tensor_unflatten__(viewed, ctx, t.size(), t.stride())
        slot = self.slots.get(key)
        if t.device.type != "cpu" or slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
            return t
        if t.data_ptr() != slot.data_ptr():
            slot.copy_(t)
        return slot


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def apply_to(module: torch.nn.Module, fn: Callable[[str, torch.Tensor], torch.Tensor], prefix: str) -> None:
    """Replace every parameter and buffer of ``module`` (recursively; ``prefix`` is the module's path
    in the model) by ``fn(key, tensor)``. Parameters stay the same Python objects, as ``Module.to``
    keeps them: a plain one takes the new tensor's data, a wrapper subclass (``QuantizedTensor``) is
    swapped in place (``torch.utils.swap_tensors``) without the ``detach`` that ``Module._apply`` adds,
    which would copy its inner tensors out of the mirror. A tensor held twice is converted once."""
    done: set[int] = set()
    for path, sub in module.named_modules():
        full = f"{prefix}.{path}" if prefix and path else (prefix or path)
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in done:
                continue
            done.add(id(p))
            new = fn(f"{full}:{name}", p)
            if new is p:
                continue
            if wrapper_inner(new) is not None:
                new.requires_grad_(p.requires_grad)
                new._is_param = True  # swap_tensors moves this into p's __dict__: p stays a Parameter
                torch.utils.swap_tensors(p, new)
            elif torch._has_compatible_shallow_copy_type(p, new):
                p.data = new
            else:  # as Module._apply does where the data cannot be set (e.g. to or from "meta")
                sub._parameters[name] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None and id(b) not in done:
                done.add(id(b))
                sub._buffers[name] = fn(f"{full}:{name}", b)


def rebind_host(model: torch.nn.Module, mirror: HostMirror) -> None:
    """Replace every host leaf of ``model`` by its slot (copying its value in): after this the model's
    host weights live in pinned memory once, with no pageable copy beside them."""
    apply_to(model, mirror.host_view, "")
