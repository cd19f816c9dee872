"""The fused elementwise / norm ops of the decode step (one Triton launch each): the engine's door
to ``norms.py``, ``rope.py`` and ``gates.py``.

At decode sizes (batch 1, S = 1..8 rows, hidden 4096) a Qwen3.5 layer is dominated by the launch
overhead of ~65 tiny torch kernels. These ops fold the elementwise and norm pieces into one launch
each and are CUDA-graph safe: no host sync, no ``.item()``, no data-dependent Python control flow,
and nothing allocated except the returned outputs. On Hopper+ they launch with programmatic
dependent launch (``kernels/pdl.py``): each lets the next kernel launch, then waits for its inputs.

Ops (each computes in float32 inside the kernel and stores in the input dtype):

* ``add_rms_norm``  residual add + RMSNorm                 ``[..., H]``         programs per (row, 512 columns)
* ``rms_norm_rope`` per-head RMSNorm + partial RoPE,       ``[B,S,Hn,D]`` ->
  written transposed for attention                         ``[B,Hn,S,D]``       one program per (row, head)
  (``rms_norm_rope_to_cache``: k written into its KV cache slots, v beside it;
  ``rms_norm_rope_qk``: q and the cache write of k and v in one launch)
* ``rope_tables``   RoPE cos/sin of S positions             ``[3,S]`` -> ``[S,R]`` one program per row
* ``silu_mul``      SwiGLU activation ``silu(g) * u``      ``[..., N]``         programs per (row, column tile)
* ``sigmoid_gate``  attention output gate ``o * sigmoid(gate)``, transposing o back to rows
                                                           ``[B,S,Hn*D]``       one program per (row, head)

``add_rms_norm``, ``silu_mul`` and ``sigmoid_gate`` take ``rotate=G``: they also return their
output ConvRot-rotated in groups of G (``y_g @ H_G`` of the rounded output, float32 products, one
rounding), which int8 ConvRot projections read directly: the row is in registers once, so the
rotation costs no launch of its own. Groups of 16 and 256 (``H_256 = H_16 (x) H_16``, two 16-wide
products, ``convrot_rows``) within one program's tile of 256 to 512 columns are done in the
kernel, other sizes and wider tiles by a ``hadamard_rotate`` launch after it. ``add_rms_norm``
also sums float32 partial products (a split-K projection), and with ``defer=True`` leaves the
row's factor to the GEMV reading its output (``kernels/row_norm.py``).

Each op has a plain-torch twin (``*_torch``; ``rope_tables``': ``engine.rope.Rope.tables``, which
the engine's torch path calls) doing the identical math; the twins are the fallback
when Triton cannot run and document the exact rounding points ("round" = cast to the input dtype),
which the kernels reproduce by casting to the dtype and back at the same places. The public ops
never fall back on their own: when ``fused_ops_reason`` says the kernels cannot run, they raise
ValueError naming the ``*_torch`` function, and the caller decides.
"""

from __future__ import annotations

from .convrot_triton import convrot_rows, tile_cols
from .gates import sigmoid_gate, sigmoid_gate_torch, silu_mul, silu_mul_torch
from .norms import add_rms_norm, add_rms_norm_torch
from .op_checks import fused_ops_reason
from .rope import (
                   rms_norm_rope,
                   rms_norm_rope_qk,
                   rms_norm_rope_to_cache,
                   rms_norm_rope_to_cache_torch,
                   rms_norm_rope_torch,
                   rope_tables,
)

__all__ = [
    "add_rms_norm", "add_rms_norm_torch", "convrot_rows", "fused_ops_reason", "rms_norm_rope", "rms_norm_rope_qk",
    "rms_norm_rope_to_cache", "rms_norm_rope_to_cache_torch", "rms_norm_rope_torch", "rope_tables",
    "sigmoid_gate", "sigmoid_gate_torch", "silu_mul", "silu_mul_torch", "tile_cols",
]
