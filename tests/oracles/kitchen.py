"""comfy-kitchen's own ConvRot code as a test oracle (skips the test where comfy-kitchen is missing)."""

from __future__ import annotations

import pytest
import torch


def kitchen_rotate(t: torch.Tensor, group: int) -> torch.Tensor:
    """comfy-kitchen's ConvRot activation rotation of ``t`` ``[..., K]`` in groups of ``group``
    (float64, on the CPU)."""
    utils = pytest.importorskip("comfy_kitchen.tensor.int8_utils")
    return utils._rotate_activation(t.double().cpu(), utils._build_hadamard(group, dtype=torch.float64), group)
