"""The runner stack of one generation: cache, runner, fused plan, CUDA graphs.

``build_runner`` is the one place that decides them; ``generate`` and the benchmarks call it.
"""

from __future__ import annotations

import logging

import torch

from ..kernels import backend_reason, resolve_backend, say_once
from ..kernels.capabilities import pdl_reason, triton_pdl_reason
from .binding import Qwen35Binding
from .cache import ModelCache
from .errors import Qwen35Error
from .forward import Runner
from .fused import FusedPlan
from .graphs import GraphRunner, graph_blocker

log = logging.getLogger(__name__)


def attention_backend(attention: str, config, dtype: torch.dtype, device) -> str:
    """The decode-attention backend that will run for ``attention``; Qwen35Error up front if the
    chosen one cannot run here."""
    q = torch.empty(1, config.num_attention_heads, 1, config.head_dim, dtype=dtype, device=device)
    scale = config.head_dim ** -0.5
    if attention == "auto":
        return resolve_backend(q, scale)
    why = backend_reason(attention, q, scale)
    if why is not None:
        raise Qwen35Error(f"attention={attention!r} cannot run here: {why}; use attention='auto'")
    return attention


def fused_plan(fused, binding: Qwen35Binding, device, dtype) -> tuple[FusedPlan | None, str | None]:
    """``(plan, None)``: the fused-kernel plan for decode rows; or ``(None, why not)`` (said once on
    CUDA as a warning; Qwen35Error when ``fused=True`` requires it)."""
    if fused is False:
        return None, "fused=False"
    if fused == "auto" and torch.device(device).type != "cuda":
        return None, f"the fused kernels need a CUDA device (running on {torch.device(device).type})"
    plan, why = FusedPlan.build(binding, device, dtype)
    if plan is None:
        if fused is True:
            raise Qwen35Error(f"fused=True but {why}; use fused='auto' or False")
        say_once(log, f"Qwen3.5 decode runs without the fused kernels (slower): {why}")
    return plan, why


def build_runner(binding: Qwen35Binding, *, capacity: int, dtype: torch.dtype, device, attention: str = "auto",
                 mtp: bool = True, fused: bool | str = "auto", cuda_graphs: bool | str = "auto",
                 cache_fill: float | None = None) -> Runner | GraphRunner:
    """A ``ModelCache`` of ``capacity`` slots (with the MTP layer's K/V when ``mtp``) and the runner
    over it (``.cache``): the fused kernels and CUDA graphs where ``fused`` / ``cuda_graphs``
    ("auto", True = required, False) and the model allow. Qwen35Error when something required
    cannot run (the attention backend, fused=True, cuda_graphs=True)."""
    attention_backend(attention, binding.config, dtype, device)
    cache = ModelCache(binding.config, batch=1, capacity=capacity, dtype=dtype, device=device, mtp=mtp,
                       fill=cache_fill)
    plan, no_plan = fused_plan(fused, binding, device, dtype)
    binding.plain_output = None if plan is None else plan.output
    binding.plain_embedding = None if plan is None else plan.embedding
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
            say_once(log, f"Qwen3.5 decode kernels launch one after another (1-3% slower on an H200): {pdl}; "
                          "install Triton 3.4 or newer")
        overlap = "on" if pdl is None else f"off ({pdl})"
        log.info("Qwen3.5 decode path: fused kernels, %s, CUDA graphs %s, overlapped launches %s", plan.describe(),
                 on, overlap)
    else:
        log.info("Qwen3.5 decode path: every layer through its module calls (no fused kernels: %s), CUDA graphs %s",
                 no_plan, on)
    return GraphRunner(runner) if graphs else runner
