"""The pack's CLIP patcher: ComfyUI's own ``ModelPatcher`` whose weight moves go through a pinned host mirror.

ComfyUI decides what to load, offload and account for (``load_models_gpu``, ``free_memory``,
``current_loaded_models``, partial / lowvram loads, "Unload models"); this class changes only how the
bytes travel. ``install(patcher)`` gives a patcher of a Qwen3.5 CLIP a subclass of its own class
(clones inherit it: ``ModelPatcher.clone`` builds ``self.__class__``) whose ``load``,
``partially_unload`` and ``unpatch_model`` run ComfyUI's code unchanged while every ``Module.to`` that
code calls on the model's modules moves the weights through the model's ``HostMirror``
(``patches/host_mirror.py``): host -> GPU as asynchronous copies from pinned memory, GPU -> host by
pointing each weight back at its pinned copy (no copy at all for weights the mirror put there), and
one synchronization when ComfyUI's call returns. The mirror is built at the model's first move to the
host (a model that never leaves the GPU costs no host memory; its first load from the file is
ComfyUI's own), is kept per model (shared by every clone, in a weak table: a deep copy of the model
copies none of it) and is ComfyUI's pinned memory (``pin_memory`` / ``unpin_memory``, its
``MAX_PINNED_MEMORY``); it is then the model's only host copy.

ComfyUI's own moves run instead, said once per model with the reason, when: the model has weight
patches (LoRA: ComfyUI patches and restores them on its own path), it does not load on a CUDA device
or offloads to one, pinned memory is off (``--disable-pinned-memory``) or its budget is spent, or the
host lacks the RAM to keep the pinned copy. ``last_move(model)`` is the latest move: bytes, seconds,
GB/s, for the node's status and the log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from dataclasses import dataclass

import torch

from .host_mirror import HostMirror, MoveCount, apply_to, rebind_host

log = logging.getLogger(__name__)

#: Host RAM left free beside the pinned copy (bytes), at the least.
RAM_HEADROOM = 2 << 30
#: Device types whose loads go through the mirror (ROCm builds name their GPUs "cuda" too).
MIRRORED_DEVICE_TYPES = ("cuda",)
GB = 1e9


@dataclass
class _ModelState:
    """What the pack keeps per model (off the module, so a deep copy of the model copies none of it)."""
    mirror: HostMirror | None = None
    depth: int = 0
    note: str | None = None
    last: dict | None = None
    note_shown: str | None = None  # the note a node's status has shown
    load_shown: dict | None = None  # the load record a node's status has shown


_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lookup(model) -> _ModelState | None:
    try:
        return _STATE.get(model)
    except TypeError:  # not weak-referenceable: not a model this module ever moved
        return None


def _state(model) -> _ModelState:
    state = _lookup(model)
    if state is None:
        state = _ModelState()
        try:
            _STATE[model] = state
        except TypeError:
            pass
    return state


def mirror_of(model) -> HostMirror | None:
    """``model``'s host mirror, once built."""
    state = _lookup(model)
    return None if state is None else state.mirror


def install(patcher) -> str | None:
    """Give ``patcher`` the swap subclass of its class. None when done (or already), else why not
    (a patcher that streams its weights per call, DynamicVRAM, keeps its own class)."""
    cls = type(patcher)
    if issubclass(cls, SwapMixin):
        return None
    if not all(hasattr(patcher, name) for name in ("load", "partially_unload", "unpatch_model", "model")):
        return "not a ComfyUI ModelPatcher"
    if bool(getattr(patcher, "is_dynamic", lambda: False)()):
        return "ComfyUI streams this model per call (DynamicVRAM)"
    patcher.__class__ = _subclass(cls)
    return None


@functools.lru_cache(maxsize=None)
def _subclass(cls: type) -> type:
    return type(f"Qwen35Swap{cls.__name__}", (SwapMixin, cls), {"__module__": __name__})


class SwapMixin:
    """``load`` / ``partially_unload`` / ``unpatch_model`` of the patcher class it is mixed into, with
    the model's weight moves through its host mirror (see the module docstring)."""

    def load(self, device_to=None, *args, **kwargs):
        with moves(self, device_to):
            return super().load(device_to, *args, **kwargs)

    def partially_unload(self, device_to, *args, **kwargs):
        with moves(self, device_to):
            return super().partially_unload(device_to, *args, **kwargs)

    def unpatch_model(self, device_to=None, *args, **kwargs):
        with moves(self, device_to):
            return super().unpatch_model(device_to, *args, **kwargs)


def prepare(patcher) -> str | None:
    """Build ``patcher``'s model mirror now rather than at its first move to the host: its host weights
    are copied in and replace the pageable copies. None when the mirror exists, else why it cannot
    (the reason is also said once, as for a move)."""
    import comfy.model_management as mm

    state = _state(patcher.model)
    if state.mirror is not None:
        return None
    why = _why_not(patcher, patcher.offload_device, mm)
    if why is None:
        state.mirror, why = _build(patcher, mm)
    if why:
        _say_once(patcher.model, why)
    return why or None


def last_move(model) -> dict | None:
    """The latest move of ``model``'s weights through its mirror: ``direction`` ("to the GPU" / "to the
    host"), ``bytes`` copied, ``kept`` (bytes moved back with no copy), ``seconds``, ``gbps``."""
    state = _lookup(model)
    return None if state is None else state.last


def move_note(model) -> str | None:
    """Why ``model``'s weights move through ComfyUI's own path (said once per model), else None."""
    state = _lookup(model)
    return None if state is None else state.note


def status_report(model) -> tuple[str | None, str | None]:
    """For a node's status after a generation: (why ComfyUI's own path moves the weights, once per
    reason; the latest return of the weights to the GPU, once per return), each None when there is
    nothing new, e.g. ``"Weights back on the GPU in 0.24 s (43.9 GB/s)."``."""
    state = _lookup(model)
    if state is None:
        return None, None
    note = None
    if state.note and state.note != state.note_shown:
        state.note_shown = state.note
        note = f"The model's weights move through ComfyUI's own path (slower): {state.note}."
    load = None
    last = state.last
    if last is not None and last["direction"] == "to the GPU" and last is not state.load_shown:
        state.load_shown = last
        load = (f"Weights back on the GPU in {last['seconds']:.2f} s ({last['gbps']:.1f} GB/s, "
                f"{last['bytes'] / GB:.2f} GB).")
    return note, load


@contextlib.contextmanager
def moves(patcher, device_to):
    """While ComfyUI's call runs: its ``Module.to`` calls on the model move weights through the mirror
    (built at the first move to the host); at the end, one synchronization and the move's record
    (outermost call only; calls nest)."""
    import comfy.model_management as mm

    model = patcher.model
    state = _state(model)
    if state.depth:
        state.depth += 1
        try:
            yield
        finally:
            state.depth -= 1
        return
    why = _why_not(patcher, device_to, mm)
    if why is not None:
        _say_once(model, why)
        yield
        return
    start = time.perf_counter()
    count = MoveCount()
    if state.mirror is not None:
        state.mirror.count = count
    paths = {id(m): p for p, m in model.named_modules()}
    installed = []
    state.depth = 1
    try:
        for module in model.modules():
            previous = module.__dict__.get("to")  # another's per-instance override: the fallback calls it
            module.__dict__["to"] = functools.partial(_fast_to, module, paths[id(module)], patcher, count, previous)
            installed.append((module, previous))
        yield
    finally:
        for module, previous in installed:
            if previous is None:
                module.__dict__.pop("to", None)
            else:
                module.__dict__["to"] = previous
        state.depth = 0
        device = torch.device(patcher.load_device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _record(model, count, time.perf_counter() - start)


def _fast_to(module, path: str, patcher, count: MoveCount, previous, *args, **kwargs):
    """``module.to(...)`` for a device move between the host and a CUDA device: through the model's
    mirror (built here at the first move to the host); torch's own ``Module.to`` for any other
    conversion (a dtype, a memory format), for loads before the mirror exists, and where it cannot be
    built (said once). ``previous``: a per-instance ``to`` that was there before, called instead of
    torch's."""
    def fallback():
        return previous(*args, **kwargs) if previous is not None else torch.nn.Module.to(module, *args, **kwargs)

    device, dtype, _non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
    if device is None or dtype is not None or fmt is not None or device.type not in ("cpu", *MIRRORED_DEVICE_TYPES):
        return fallback()
    state = _state(patcher.model)
    if state.mirror is None and device.type == "cpu":
        import comfy.model_management as mm

        state.mirror, why = _build(patcher, mm)
        if state.mirror is not None:
            state.mirror.count = count
        else:
            _say_once(patcher.model, why)
    if state.mirror is None:
        return fallback()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    apply_to(module, lambda key, t: state.mirror.move(key, t, device), path)
    return module


def _record(model, count: MoveCount, seconds: float) -> None:
    copied = count.to_device + count.to_host
    if not copied and not count.kept:
        return
    direction = "to the GPU" if count.to_device >= count.to_host + count.kept else "to the host"
    moved = count.to_device if direction == "to the GPU" else count.to_host + count.kept
    record = {"direction": direction, "bytes": moved, "copied": copied, "kept": count.kept,
              "unmirrored": count.unmirrored, "seconds": seconds, "gbps": moved / GB / max(seconds, 1e-9)}
    _state(model).last = record
    log.info("Qwen3.5: weights %s: %.2f GB in %.3f s (%.1f GB/s%s)", direction, moved / GB, seconds,
             record["gbps"], ", no copy" if direction == "to the host" and not count.to_host else "")


def _why_not(patcher, device_to, mm) -> str | None:
    if device_to is None:
        return ""
    load, offload = torch.device(patcher.load_device), torch.device(patcher.offload_device)
    if load.type not in MIRRORED_DEVICE_TYPES or offload.type != "cpu":
        return ""  # nothing crosses the bus (CPU runs, --gpu-only): nothing to say
    if getattr(patcher, "patches", None) or getattr(patcher, "weight_wrapper_patches", None):
        return "the CLIP has weight patches (a LoRA): ComfyUI moves and patches its weights itself"
    if not (hasattr(mm, "pin_memory") and hasattr(mm, "unpin_memory")):
        return "this ComfyUI has no pinned-memory support (update ComfyUI)"
    if getattr(mm, "MAX_PINNED_MEMORY", 0) <= 0:
        return "pinned memory is off in ComfyUI (--disable-pinned-memory, or not an NVIDIA / AMD GPU)"
    return None


def _build(patcher, mm) -> tuple[HostMirror | None, str | None]:
    """The model's mirror, its host leaves moved in (ComfyUI's own pins of them released first, through
    its ``unpin_all_weights``), or None and why not."""
    import psutil

    model = patcher.model
    size = sum(t.numel() * t.element_size() for _key, t in _leaves(model))
    on_host = sum(t.numel() * t.element_size() for _key, t in _leaves(model) if t.device.type == "cpu")
    budget = int(mm.MAX_PINNED_MEMORY - getattr(mm, "TOTAL_PINNED_MEMORY", 0))
    if budget < size:
        return None, (f"ComfyUI's pinned-memory budget has {max(budget, 0) / GB:.1f} GB left, the model needs "
                      f"{size / GB:.1f} GB (unload other models, or add host RAM)")
    available = psutil.virtual_memory().available + on_host
    if available - size < RAM_HEADROOM:
        return None, (f"the host has {available / GB:.1f} GB of free RAM for a {size / GB:.1f} GB pinned copy "
                      "(close other programs, or add RAM)")
    mirror = HostMirror.build(model, mm.pin_memory, budget)
    if not mirror.slots:
        mirror.release(mm.unpin_memory)
        return None, "ComfyUI refused to pin host memory for the model"
    if mirror.missing:
        log.info("Qwen3.5: %d tensors move through ComfyUI's own path (%s)", len(mirror.missing),
                 next(iter(mirror.missing.values())))
    if hasattr(patcher, "unpin_all_weights"):
        patcher.unpin_all_weights()  # ComfyUI's registrations of the pageable copies the slots replace
    rebind_host(model, mirror)
    weakref.finalize(model, mirror.release, mm.unpin_memory)
    log.info("Qwen3.5: the model's weights live in %.2f GB of pinned host memory (ComfyUI's budget): they move "
             "to and from the GPU at the bus's speed", mirror.pinned_bytes / GB)
    return mirror, None


def _leaves(model):
    from .host_mirror import model_leaves

    return model_leaves(model)


def _say_once(model, why: str) -> None:
    state = _state(model)
    if not why or state.note == why:
        return
    state.note = why
    log.warning("Qwen3.5: the model's weights move through ComfyUI's own path (slower): %s", why)
