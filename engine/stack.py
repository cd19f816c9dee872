"""The runner stack of one generation: cache, runner, fused plan, CUDA graphs.

``build_runner`` is the one place that decides them; ``generate`` and the benchmarks call it.
"""

from __future__ import annotations

import logging

import torch

from ..kernels import backend_for, say_once
from ..kernels.capabilities import pdl_reason, triton_pdl_reason
from . import held
from .binding import Qwen35Binding
from .cache import ModelCache
from .errors import Qwen35Error, exception_line
from .forward import Runner
from .fused import FusedPlan
from .graphs import GraphRunner, graph_blocker

log = logging.getLogger(__name__)


def attention_backend(attention: str, config, dtype: torch.dtype, device) -> str:
    """The decode-attention backend that will run for ``attention``; Qwen35Error up front if the
    chosen one cannot run here."""
    backend, why = backend_for(attention, config.num_attention_heads, config.head_dim, dtype, device)
    if why is not None:
        raise Qwen35Error(f"attention={attention!r} cannot run here: {why}; use attention='auto'")
    return backend


def _on_cuda(device) -> bool:
    """Where "auto" takes the fused kernels and where a ``trial_step`` comes first: CUDA (Triton
    compiles for the GPU there; a kernel that cannot compile must not break a generation)."""
    return torch.device(device).type == "cuda"


def fused_plan(fused, binding: Qwen35Binding, device, dtype) -> tuple[FusedPlan | None, str | None]:
    """``(plan, None)``: the fused-kernel plan for decode rows; or ``(None, why not)`` (said once on
    CUDA as a warning; Qwen35Error when ``fused=True`` requires it)."""
    if fused is False:
        return None, "fused=False"
    if fused == "auto" and not _on_cuda(device):
        return None, f"the fused kernels need a CUDA device (running on {torch.device(device).type})"
    plan, why = FusedPlan.build(binding, device, dtype)
    if plan is None:
        if fused is True:
            raise Qwen35Error(f"fused=True but {why}; use fused='auto' or False")
        say_once(log, f"Qwen3.5 decode runs without the fused kernels (slower): {why}")
    return plan, why


#: ``trial_key`` -> the outcome of ``trial_step`` (None: ran), once per process.
_TRIED: dict[tuple, str | None] = {}


def trial_key(binding: Qwen35Binding, plan: FusedPlan, device, dtype: torch.dtype, attention: str,
              rows: tuple[int, ...]) -> tuple:
    """What decides which kernels a trial step compiles: the device, dtypes, model shape, plan and rows."""
    cfg = binding.config
    return (str(torch.device(device)), dtype, attention, cfg.hidden_size, cfg.num_hidden_layers, plan.describe(),
            rows)


def trial_step(binding: Qwen35Binding, plan: FusedPlan, *, device, dtype: torch.dtype, attention: str,
               rows: tuple[int, ...] = (1,)) -> str | None:
    """None when the fused decode step, and the output projection, run on throwaway state for
    each row count in ``rows`` (their kernels compile there), else why not: the exception's type and
    first line. Once per ``trial_key`` in a process. For each row count r a fresh cache of r + 1
    slots (on a 9B model about 50 MB of DeltaNet state, and the step stages r - 1 rows of it), freed
    after; zero inputs; the model's own cache and weights are not touched. CUDA out-of-memory
    propagates (not a kernel fault)."""
    key = trial_key(binding, plan, device, dtype, attention, rows)
    if key in _TRIED:
        return _TRIED[key]
    why = None
    try:
        with torch.no_grad():
            for r in rows:
                cache = ModelCache(binding.config, batch=1, capacity=r + 1, dtype=dtype, device=device, mtp=False)
                runner = Runner(binding, cache, dtype=dtype, device=device, attention=attention, fused=plan)
                x = torch.zeros(1, r, binding.config.hidden_size, dtype=dtype, device=device)
                runner.forward_logits(x, torch.arange(r, device=device).expand(3, r).contiguous())
                del runner, cache
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any fault of the fused path is a reason to run without it
        why = exception_line(exc)
    _TRIED[key] = why
    return why


def build_runner(binding: Qwen35Binding, *, capacity: int, dtype: torch.dtype, device, attention: str = "auto",
                 mtp: bool = True, fused: bool | str = "auto", cuda_graphs: bool | str = "auto",
                 cache_fill: float | None = None, verify_rows: int = 1, keep: bool = False) -> Runner | GraphRunner:
    """A ``ModelCache`` of ``capacity`` slots (with the MTP layer's K/V when ``mtp``) and the runner
    over it (``.cache``): the fused kernels and CUDA graphs where ``fused`` / ``cuda_graphs``
    ("auto", True = required, False) and the model allow; its ``decode_path`` says which, in short
    (for the node's status line), with the reason where the fused kernels or graphs are off. On
    CUDA the fused path first runs a ``trial_step`` (1 row and ``verify_rows``, the MTP verify's
    rows); if that fails, "auto" runs the modules instead and says why once. ``keep``: the stack
    the last generation of this model left (``held.take``) is returned when it fits (its
    ``binding`` is that generation's, over the same modules; its cache may be larger and hold the
    MTP head's K/V when ``mtp`` is off), and the stack gets its ``stack_key`` for ``held.rest``.
    Qwen35Error when something required cannot run (the attention backend, fused=True,
    cuda_graphs=True)."""
    backend = attention_backend(attention, binding.config, dtype, device)
    plan, no_plan = fused_plan(fused, binding, device, dtype)
    binding.plain_output = None if plan is None else plan.output
    binding.plain_embedding = None if plan is None else plan.embedding
    if plan is not None and _on_cuda(device):
        failed = trial_step(binding, plan, device=device, dtype=dtype, attention=attention,
                            rows=tuple(sorted({1, verify_rows})))
        if failed is not None:
            import triton

            no_plan = (f"the fused kernels failed on a trial step (Triton {triton.__version__}, torch "
                       f"{torch.__version__}): {failed}")
            binding.plain_output = binding.plain_embedding = plan = None
            if fused is True:
                raise Qwen35Error(f"fused=True but {no_plan}")
            say_once(log, f"Qwen3.5 decode runs without the fused kernels (slower): {no_plan}; please report "
                          "this with the versions named")
    key = None
    if keep:
        key = held.stack_key(binding, dtype=dtype, device=device, attention=attention, fused=fused,
                             cuda_graphs=cuda_graphs)
        blocks = (lambda b, p: graph_blocker(b, torch.device(device), dtype, attention, p)) if cuda_graphs else None
        kept = held.take(binding, key, capacity, mtp, plan, blocks)
        if kept is not None:
            kept.decode_path = kept.decode_base + " (kept from the last generation)"
            log.info("Qwen3.5 decode path: the last generation's (%s)", kept.decode_base)
            return kept
    base = held.allocated(device)  # after a kept stack that no longer fits is freed
    cache = ModelCache(binding.config, batch=1, capacity=capacity, dtype=dtype, device=device, mtp=mtp,
                       fill=cache_fill)
    runner = Runner(binding, cache, dtype=dtype, device=device, attention=attention, fused=plan)
    blocker = graph_blocker(binding, torch.device(device), dtype, attention, plan) if cuda_graphs else None
    if blocker is not None:
        if cuda_graphs is True:
            raise Qwen35Error(f"cuda_graphs=True but {blocker}; use cuda_graphs='auto' or False")
        if torch.device(device).type == "cuda":
            say_once(log, f"Qwen3.5 decode runs without CUDA graphs: {blocker}")
    graphs = bool(cuda_graphs) and blocker is None
    on = "on" if graphs else "off" if blocker is None else f"off ({blocker})"
    if plan is not None:
        pdl = pdl_reason(device)
        if pdl is not None and pdl == triton_pdl_reason():  # a Hopper+ GPU whose Triton cannot overlap
            say_once(log, f"Qwen3.5 decode kernels launch one after another, a little slower: {pdl}; "
                          "install Triton 3.4 or newer")
        overlap = "on" if pdl is None else f"off ({pdl})"
        log.info("Qwen3.5 decode path: fused kernels, %s, CUDA graphs %s, overlapped launches %s, attention '%s'",
                 plan.describe(), on, overlap, backend)
    else:
        log.info("Qwen3.5 decode path: every layer through its module calls (no fused kernels: %s), CUDA graphs %s, "
                 "attention '%s'", no_plan, on, backend)
    out = GraphRunner(runner, required=cuda_graphs is True) if graphs else runner
    out.decode_path = out.decode_base = (
        "Triton kernels" if plan is not None else f"module calls (no Triton kernels: {no_plan})") + (
        ", CUDA graphs" if graphs else f", no CUDA graphs ({blocker or 'cuda_graphs=False'})")
    out.stack_key, out.stack_bytes, out.stack_base = key, None, base
    return out
