"""The runner stack kept between generations: the last generation's cache, runner, fused plan and
CUDA graphs, reused by the next generation of the same model when nothing they read has moved.

Capturing a step's CUDA graphs costs a sizable share of a short answer's time (measured:
``benchmarks/CHANGELOG.md``), so the stack is kept. ``take`` gives the kept stack back when:

* the request matches (``stack_key``: dtype, device, attention, fused / graph settings, the
  model's modules and weight hooks, inference mode), the kept cache has room (``capacity`` at least the
  request's: capacities are rounded up to ``CAPACITY_STEP`` slots so prompts of similar length
  share one) and, for MTP, the MTP head's cache (a stack with it serves MTP off too);
* every module and every parameter / buffer of the model (the inner tensors of a wrapper such as
  ComfyUI's ``QuantizedTensor``) is the same object at the same address, shape and stride
  (``_fingerprint``): every address a graph reads is still the model's live weight;
* a fused plan built now (``fused_plan``, as a fresh stack would) reads the same storage in the
  same places, with derived tensors (norm scales, conv weights) of the same shapes: their current
  values are copied into the kept ones (a weight patched in place is seen), and
* nothing a step calls has become unsafe to capture (``graphs.graph_blocker``).

Otherwise the kept stack is released and a fresh one built. At rest the stack pins no weight: every
tensor of it that views the model's storage is an alias (``_alias``) emptied with ``set_()`` and
pointed back at the same storage on reuse, so a weight ComfyUI moves off the GPU (a partial unload)
is freed as ComfyUI expects. The stack is an attribute of the transformer module (``ATTR``): it
never outlives the model, and a deep copy of the module does not copy it. One stack is kept per
device, and only when its memory is at most ``REST_SHARE`` of the device's (``REST_BYTES_CPU`` on
the CPU). ``release(module)`` / ``release_within(root)`` free it (ComfyUI's detach calls this through
``patches.comfy_weights``); ``release_all`` frees every one.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .forward import deltanet_constants

log = logging.getLogger(__name__)

#: Module attribute that holds a model's kept stack.
ATTR = "_qwen35_fast_kept_stack"
#: Cache capacities are rounded up to this many slots (one kept cache serves prompts of similar length).
CAPACITY_STEP = 1024
#: Most of a GPU's memory one kept stack may hold; more is released after the generation.
REST_SHARE = 0.05
#: The same bound for a stack on the CPU, in bytes.
REST_BYTES_CPU = 1 << 30
_PACK = __name__.rsplit(".", 2)[0] + "."
_KEPT: weakref.WeakSet = weakref.WeakSet()


def rounded_capacity(capacity: int) -> int:
    """``capacity`` rounded up to ``CAPACITY_STEP`` slots."""
    return -(-capacity // CAPACITY_STEP) * CAPACITY_STEP


def allocated(device) -> int:
    """Bytes the caching allocator has handed out on ``device`` (0 off CUDA)."""
    device = torch.device(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _none():
    return None


class _Kept:
    """A stack at rest: ``runner`` (GraphRunner or Runner, its binding and plan inside), ``key``,
    ``prints`` (``_fingerprint`` at rest), ``pins`` (``id(alias) -> (alias, storage address,
    offset, size, stride)``), ``bytes`` (device memory it holds, estimated)."""

    def __init__(self, runner, key: tuple, prints: list, pins: dict, nbytes: int):
        self.runner, self.key, self.prints, self.pins, self.bytes = runner, key, prints, pins, nbytes
        self.device = runner.device

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _none, ()


def stack_key(binding, *, dtype, device, attention: str, fused, cuda_graphs) -> tuple:
    """What a kept stack must match besides capacity, the MTP cache and the weights; also whether
    inference mode is on (ComfyUI runs nodes in it; its tensors refuse in-place updates outside)."""
    return (str(torch.device(device)), dtype, attention, fused, cuda_graphs, id(binding.transformer),
            id(binding.mtp), binding.weight_cast, type(binding.weights), torch.is_inference_mode_enabled())


# ---------------------------------------------------------------------------------------- weights
def _leaves(t: torch.Tensor):
    """The plain tensors holding ``t`` (itself, or a wrapper subclass's inner tensors)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            yield from _leaves(inner)


def _fingerprint(binding) -> tuple[list, dict]:
    """``(prints, storages)``: every module's id and every parameter / buffer leaf's address,
    offset, shape, stride, dtype and device, in model order; and storage address -> a leaf on it."""
    prints, storages = [], {}
    for root in (binding.transformer, binding.mtp):
        if root is None:
            continue
        for name, mod in root.named_modules():
            prints.append((name, id(mod)))
            for pname, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is None:
                    continue
                for leaf in _leaves(t):
                    ptr = leaf.untyped_storage().data_ptr()
                    storages.setdefault(ptr, leaf)
                    prints.append((pname, ptr, leaf.storage_offset(), tuple(leaf.shape), leaf.stride(), leaf.dtype,
                                   str(leaf.device)))
    return prints, storages


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``t``'s storage (one ``set_`` may re-point, whatever made ``t``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _walk(obj, on_tensor, seen: set):
    """``obj`` with every tensor reachable through dicts, lists, tuples and this pack's objects
    replaced by ``on_tensor(t)`` (containers and objects changed in place; a changed tuple is
    rebuilt and returned). Modules, bindings and anything not of this pack are left alone."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if id(obj) in seen or isinstance(obj, torch.nn.Module) or type(obj).__name__ == "Qwen35Binding":
        return obj
    if isinstance(obj, dict):
        seen.add(id(obj))
        for k, v in list(obj.items()):
            new = _walk(v, on_tensor, seen)
            if new is not v:
                obj[k] = new
    elif isinstance(obj, list):
        seen.add(id(obj))
        for i, v in enumerate(obj):
            new = _walk(v, on_tensor, seen)
            if new is not v:
                obj[i] = new
    elif isinstance(obj, tuple):
        items = [_walk(v, on_tensor, seen) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            return type(obj)(*items) if hasattr(type(obj), "_fields") else tuple(items)
    elif type(obj).__module__.startswith(_PACK):
        seen.add(id(obj))
        names = list(getattr(obj, "__dict__", {})) + [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        for name in names:
            v = getattr(obj, name, None)
            new = _walk(v, on_tensor, seen)
            if new is not v:
                object.__setattr__(obj, name, new)
    return obj


def _walk_tensors(obj) -> list[torch.Tensor]:
    """Every tensor ``_walk`` reaches from ``obj``."""
    out: list[torch.Tensor] = []
    _walk(obj, lambda t: out.append(t) or t, set())
    return out


def _plan_tensors(plan, consts: dict) -> list[torch.Tensor]:
    """The tensors a build derives or reads, in build order: the fused plan's norms, convs,
    projections, output, embedding and prefetch targets, and the DeltaNet constants."""
    roots = [consts] if plan is None else \
        [plan.norms, plan.convs, plan.linears, plan.output, plan.embedding, plan.prefetch, consts]
    return _walk_tensors(roots)


# ---------------------------------------------------------------------------------------- rest / take
def rest(runner, nbytes: int) -> bool:
    """Keep ``runner`` (the stack a generation just finished with, ``build_runner(keep=True)``) on
    its model: aliases replace its views of the model's storage and are emptied; other stacks on
    the device are released first. ``nbytes``: the device memory the stack holds (recomputed from
    the cache off CUDA). False (nothing kept) when that is over the device's bound or a view of the
    weights cannot be aliased (said in the log)."""
    binding = runner.binding
    device = torch.device(runner.device)
    if device.type != "cuda":
        nbytes = sum(t.numel() * t.element_size() for t in _walk_tensors(runner.cache))
    fresh, runner.stack_bytes = runner.stack_bytes is None, nbytes
    limit = (REST_SHARE * torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else REST_BYTES_CPU)
    if nbytes > limit:
        log.info("Qwen3.5: the decode stack (%.0f MB) is not kept for the next generation (more than %.0f MB)",
                 nbytes / 2**20, limit / 2**20)
        return False
    for other in list(_KEPT):
        if other.device == runner.device and other.runner is not runner:
            release(other.runner.binding.transformer)
    prints, storages = _fingerprint(binding)
    storages.pop(0, None)
    pins, made, ours = {}, {}, getattr(runner, "stack_pins", {})  # ours: the aliases of its last rest

    def unpin(t):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            if any(leaf.untyped_storage().data_ptr() in storages for leaf in _leaves(t)):
                raise _Unkeepable(f"a {type(t).__name__} over the model's weights")
            return t
        if t.device.type == "meta" or t.untyped_storage().data_ptr() not in storages:
            return t
        if id(t) in ours:
            made[id(t)] = t
            pins[id(t)] = ours[id(t)]
        if id(t) not in made:
            a = _alias(t)
            made[id(t)] = a
            pins[id(a)] = (a, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        return made[id(t)]

    inner = getattr(runner, "runner", runner)
    inner._int8.clear()  # the module path's lazily read int8 weights: read again on use
    inner.failed_module = None
    try:
        _walk(runner, unpin, set())
    except _Unkeepable as exc:
        log.info("Qwen3.5: the decode stack is not kept for the next generation: it holds %s", exc)
        return False
    plan = inner.fused
    binding.plain_output = None if plan is None else plan.output
    binding.plain_embedding = None if plan is None else plan.embedding
    for a, *_ in pins.values():
        a.set_()
    runner.stack_pins = pins
    if fresh:
        log.info("Qwen3.5: the decode stack (%d cache slots%s; %.0f MB) is kept for the next generation while the "
                 "model stays loaded", runner.cache.capacity, " and CUDA graphs" if hasattr(runner, "ready_depths")
                 else "", nbytes / 2**20)
    kept = _Kept(runner, runner.stack_key, prints, pins, nbytes)
    object.__setattr__(binding.transformer, ATTR, kept)
    _KEPT.add(kept)
    return True


class _Unkeepable(Exception):
    pass


def take(binding, key: tuple, capacity: int, mtp: bool, fresh_plan, blocker) -> object | None:
    """The stack kept on ``binding``'s model, ready to run (pins re-pointed, cache emptied, derived
    tensors refreshed from ``fresh_plan``), or None (none kept, or it no longer fits: released).
    ``mtp``: the request drafts (the cache needs the MTP head's K/V). ``blocker(binding, plan)``:
    ``graphs.graph_blocker`` for the kept plan (None: capturable), or None when CUDA graphs are off."""
    kept = getattr(binding.transformer, ATTR, None)
    if kept is None:
        return None
    object.__setattr__(binding.transformer, ATTR, None)
    _KEPT.discard(kept)
    runner = kept.runner
    why = _mismatch(kept, binding, key, capacity, fresh_plan)
    if why is None and mtp and runner.cache.mtp is None:
        why = "MTP needs the MTP head's cache, which the kept stack (MTP off) lacks"
    if why is None and blocker is not None:
        graphs = type(runner).__name__ == "GraphRunner"
        why_not = blocker(runner.binding, getattr(runner, "runner", runner).fused)
        if graphs and why_not is not None:
            why = why_not
        elif not graphs and why_not is None:
            why = "CUDA graphs can run now"
    if why is not None:
        log.info("Qwen3.5: the kept decode stack is rebuilt: %s", why)
        return None
    runner.cache.reset()
    return runner


def _mismatch(kept: _Kept, binding, key: tuple, capacity: int, fresh_plan) -> str | None:
    """Why ``kept`` cannot serve this request (None: it can; then its aliases point at the weights
    again and its derived tensors hold ``fresh_plan``'s values)."""
    if kept.key != key:
        return "the request's settings or the model changed"
    if kept.runner.cache.capacity < capacity:
        return f"the prompt and max_length need {capacity} cache slots, {kept.runner.cache.capacity} are kept"
    prints, storages = _fingerprint(binding)
    storages.pop(0, None)
    if prints != kept.prints:
        return "the model's weights moved or changed (a reload, an offload or a patch)"
    inner = getattr(kept.runner, "runner", kept.runner)
    if (inner.fused is None) != (fresh_plan is None):
        return "the fused kernels' plan changed"
    old = _plan_tensors(inner.fused, inner._consts)
    new = _plan_tensors(fresh_plan, deltanet_constants(kept.runner.binding, inner.device))
    if len(old) != len(new) or (fresh_plan is not None and fresh_plan.describe() != inner.fused.describe()):
        return "the fused kernels' plan changed"
    copies = []
    for o, n in zip(old, new):
        pin = kept.pins.get(id(o))
        if pin is not None:
            if (n.untyped_storage().data_ptr(), n.storage_offset(), tuple(n.shape), n.stride()) != pin[1:] or \
                    n.dtype != o.dtype:
                return "a projection is read from other storage than before"
        elif n.shape != o.shape or n.dtype != o.dtype or n.stride() != o.stride():
            return "a derived tensor of the plan changed shape"
        else:
            copies.append((o, n))
    for a, ptr, offset, size, stride in kept.pins.values():
        a.set_(storages[ptr].untyped_storage(), offset, size, stride)
    for o, n in copies:
        if n.data_ptr() != o.data_ptr():
            o.copy_(n)
    return None


# ---------------------------------------------------------------------------------------- release
def release(module) -> bool:
    """Free the stack kept on ``module`` (a transformer). True when one was kept."""
    kept = getattr(module, ATTR, None)
    if kept is None:
        return False
    object.__setattr__(module, ATTR, None)
    _KEPT.discard(kept)
    return True


def release_within(root) -> int:
    """Free the stacks kept on ``root`` or any module inside it; how many there were."""
    return sum(release(m) for m in root.modules() if getattr(m, ATTR, None) is not None)


def release_all() -> int:
    """Free every kept stack of the process; how many there were."""
    return sum(release(k.runner.binding.transformer) for k in list(_KEPT))


def kept_stacks() -> list:
    """The kept stacks' runners (for tests and benchmarks)."""
    return [k.runner for k in _KEPT]
