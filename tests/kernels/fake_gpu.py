"""A GPU that is not there: Triton compiles the pack's kernels for it on a machine without one.

``install(cc, shared)`` makes Triton's active driver report an NVIDIA GPU of compute capability
``cc`` whose blocks may opt in to ``shared`` bytes of shared memory. A kernel then compiles for that
target as on such a GPU (Triton's own compiler and ptxas), and its launch goes through Triton's own
resource check (``CompiledKernel._init_handles``: a kernel that needs more shared memory than the
device has raises ``OutOfResources`` there, as on the GPU). What passes is recorded in
``FakeGPU.launched`` instead of run: tensors stay on the CPU and outputs are never written.

Use it in a fresh process: install it before the first kernel compiles, and import kernel modules
without ``TRITON_INTERPRET`` (``triton.jit`` decides when it decorates whether a kernel is
interpreted). ``tests/kernels/consumer_step.py`` drives the decode step's kernels through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


@dataclass
class Launch:
    kernel: str
    shared: int  # bytes of shared memory, as Triton compiled it
    warps: int
    stages: int
    grid: tuple[int, int, int]


class _Utils:
    def __init__(self, gpu: FakeGPU):
        self.gpu = gpu

    def get_device_properties(self, device):
        return {"max_shared_mem": self.gpu.shared, "multiprocessor_count": self.gpu.sms, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 2_000_000, "mem_clock_rate": 10_000_000, "mem_bus_width": 256}

    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills[, max threads per block]: Triton 3.4+)
        return (0, 0, 0, 0, 1024) if _TRITON >= (3, 4) else (0, 0, 0, 0)


class FakeGPU:
    """Triton's active driver for a GPU of compute capability ``cc`` (e.g. 89) with ``shared``
    bytes of shared memory per block and ``sms`` multiprocessors."""

    def __init__(self, cc: int, shared: int, sms: int = 46):
        self.target = GPUTarget("cuda", cc, 32)
        self.shared, self.sms = shared, sms
        self.utils = _Utils(self)
        self.launched: list[Launch] = []

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def launcher_cls(self, src, metadata):
        name = getattr(getattr(src, "fn", None), "__name__", str(src))

        def launch(grid_0, grid_1, grid_2, *args):
            self.launched.append(Launch(name, int(metadata.shared), int(metadata.num_warps),
                                        int(metadata.num_stages), (grid_0, grid_1, grid_2)))

        return launch


def install(cc: int, shared: int, sms: int = 46) -> FakeGPU:
    """Make a ``FakeGPU`` Triton's active driver and return it. RuntimeError naming this Triton's
    version when its runtime does not have the hooks used here."""
    if not hasattr(driver, "set_active"):
        raise RuntimeError(f"tests/kernels/fake_gpu.py: Triton {triton.__version__} has no driver.set_active")
    gpu = FakeGPU(cc, shared, sms)
    driver.set_active(gpu)
    return gpu
