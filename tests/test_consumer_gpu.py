"""The decode step's kernels compiled for GPUs this machine does not have (``tests/consumer_step.py``).

A consumer GPU (RTX 30/40/50, compute capability 8.6 / 8.9 / 12.0) lets a block use about 99 KB
of shared memory where an H200 lets it use 227 KB, and the launch configs were tuned on the H200.
Every kernel the 9B decode step launches is compiled here by Triton for such a GPU and goes through
Triton's own shared memory check at launch (``tests/fake_gpu.py``); nothing runs. The test asks
what a user on that GPU would see: no launch fails, every launch fits, and a GEMV that runs with
fewer pipeline stages than the pack picked says so (a warning naming the config). How much shared
memory a launch needs depends on the Triton version (the grouped GEMV's branches share their
buffers in part in Triton 3.6 and not at all in 3.9), so the test asserts no sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402, F401  (a Triton with an NVIDIA backend)

STEP = Path(__file__).resolve().parent / "consumer_step.py"
CONSUMER = 99 * 1024  # shared memory a block may opt in to on compute capability 8.6, 8.9 and 12.0
HOPPER = 227 * 1024

#: (compute capability, shared bytes, [(activation dtype, weight format)], rows): the Comfy-Org int8
#: file in bf16 at the decode, MTP-3 verify and 8-row shapes; fp8, bf16 weights, fp16 and float32
#: activations (``--fp32-text-enc``) at one row; a Blackwell consumer GPU and an H100 / H200 with
#: programmatic dependent launch.
GPUS = {
    "sm_89": (89, CONSUMER, [["bfloat16", "int8"]], [1, 4, 8]),
    "sm_89 other formats": (89, CONSUMER, [["bfloat16", "fp8"], ["bfloat16", "float"], ["float16", "int8"],
                                           ["float32", "int8"]], [1]),
    "sm_120": (120, CONSUMER, [["bfloat16", "int8"]], [1, 4]),
    "sm_90": (90, HOPPER, [["bfloat16", "int8"], ["bfloat16", "float"]], [1]),
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Each entry of ``GPUS`` through ``consumer_step.py``, two processes at a time (each compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out, names = {}, list(GPUS)
    for start in range(0, len(names), 2):
        procs = {}
        for name in names[start:start + 2]:
            cc, shared, cells, rows = GPUS[name]
            spec = json.dumps({"cc": cc, "shared": shared, "cells": cells, "rows": rows})
            procs[name] = subprocess.Popen([sys.executable, str(STEP), spec], env=env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=1200)
            assert proc.returncode == 0, f"{name}: consumer_step.py failed:\n{stderr[-4000:]}"
            out[name] = json.loads(stdout)
    return out


def _split(result: dict) -> tuple[list[dict], list[dict]]:
    """(the step's calls, the calls that must fail)."""
    step = [c for c in result["calls"] if not c["call"].endswith("explicit config past the limit")]
    checks = [c for c in result["calls"] if c["call"].endswith("explicit config past the limit")]
    return step, checks


@pytest.mark.parametrize("name", list(GPUS))
def test_the_shared_memory_check_is_live(compiled, name):
    """A launch config given explicitly is never shrunk; one that needs more shared memory than
    the GPU has must fail with Triton's OutOfResources, or the rest of this file proves nothing."""
    _, checks = _split(compiled[name])
    assert checks, "consumer_step.py made no check call"
    for c in checks:
        assert c["error"] and c["error"].startswith("OutOfResources"), (c["call"], c["error"], c["launches"])


@pytest.mark.parametrize("name", list(GPUS))
def test_every_decode_kernel_launches_within_the_gpus_shared_memory(compiled, name):
    cc, shared, _, _ = GPUS[name]
    step, _ = _split(compiled[name])
    failed = [(c["call"], c["error"]) for c in step if c["error"]]
    assert not failed, f"Triton {compiled[name]['triton']}, sm_{cc}: " + "\n".join(f"{n}: {e}" for n, e in failed)
    for c in step:
        assert c["launches"], f"{c['call']}: no Triton kernel launched (a torch path was taken)"
        for launch in c["launches"]:
            assert launch["shared"] <= shared, (c["call"], launch)


@pytest.mark.parametrize("name", list(GPUS))
def test_a_gemv_with_fewer_stages_than_picked_says_so(compiled, name):
    """No silent fallback: where the GEMV launched with fewer pipeline stages than the config the
    pack picked, the process logged a warning naming that config and the stages it runs with."""
    step, _ = _split(compiled[name])
    warnings = compiled[name]["warnings"]
    gemvs = [c for c in step if c["picked"] is not None]
    assert gemvs
    for c in gemvs:
        (launch,) = c["launches"]
        picked = tuple(c["picked"])
        if launch["stages"] < picked[3]:
            said = [w for w in warnings if str(picked) in w and f"runs with {launch['stages']} pipeline stages" in w]
            assert said, f"{c['call']}: {picked} ran with {launch['stages']} stages and nothing said so: {warnings}"
        else:
            assert launch["stages"] == picked[3], (c["call"], picked, launch)
