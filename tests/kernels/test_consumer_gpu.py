"""The decode step's kernels compiled for GPUs this machine does not have (``tests/kernels/consumer_step.py``).

A consumer GPU (RTX 30/40/50, compute capability 8.6 / 8.9 / 12.0) lets a block use about 99 KB
of shared memory where an H200 lets it use 227 KB, and the launch configs were tuned on the H200.
Every kernel the 9B decode step launches is compiled here by Triton for such a GPU and goes through
Triton's own shared memory check at launch (``tests/kernels/fake_gpu.py``); nothing runs. The test asks
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
import zipfile
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
#: programmatic dependent launch (int8 also at the verify's 4 rows, whose DeltaNet inputs pick tiles
#: a consumer GPU does not fit).
GPUS = {
    "sm_89": (89, CONSUMER, [["bfloat16", "int8"]], [1, 4, 8]),
    "sm_89 other formats": (89, CONSUMER, [["bfloat16", "fp8"], ["bfloat16", "float"], ["float16", "int8"],
                                           ["float32", "int8"]], [1]),
    "sm_120": (120, CONSUMER, [["bfloat16", "int8"]], [1, 4]),
    "sm_89 4-bit": (89, CONSUMER, [["bfloat16", "w4a4"], ["bfloat16", "nvfp4"]], [1, 4]),
    "sm_90": (90, HOPPER, [["bfloat16", "int8"], ["bfloat16", "float"]], [1]),
    "sm_90 verify": (90, HOPPER, [["bfloat16", "int8"]], [4]),
}


#: torch 2.6's Triton, the newest without K-sliced tiles (``gemv.SLICES_REASON``): with them its
#: compiler aborts the process. Triton 3.0 and 3.1 (torch 2.4, 2.5) refuse them alike; checked by hand.
OLD_TRITON = "3.2.0"
#: torch 2.8's Triton, the first whose launcher takes ``launch_pdl``: its own ``gdc_wait`` /
#: ``gdc_launch_dependents`` do not compile (they take ``_builder``, its compiler passes ``_semantic``).
PDL_TRITON = "3.4.0"
#: torch 2.10 / 2.11's Triton: it type-checks an inline asm's arguments pairwise, as a binary op's
#: (two pointers of different types, or a pointer and a float, are refused; 3.9 only broadcasts them).
ASM_TRITON = "3.6.0"


def _run_step(spec: dict, pythonpath: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, str(STEP), json.dumps(spec)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(name: str, proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"{name}: consumer_step.py failed ({proc.returncode}):\n{stderr[-4000:]}"
    return json.loads(stdout)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Each entry of ``GPUS`` through ``consumer_step.py``, two processes at a time (each compiles)."""
    out, names = {}, list(GPUS)
    for start in range(0, len(names), 2):
        procs = {}
        for name in names[start:start + 2]:
            cc, shared, cells, rows = GPUS[name]
            procs[name] = _run_step({"cc": cc, "shared": shared, "cells": cells, "rows": rows})
        for name, proc in procs.items():
            out[name] = _result(name, proc)
    return out


def _unpacked_triton(version: str) -> Path:
    """Triton ``version`` unpacked from its wheel for this Python (``pip download``, kept in
    ``$QWEN35_FAST_CI_CACHE``); skips when no such wheel can be had here."""
    cache = Path(os.environ.get("QWEN35_FAST_CI_CACHE") or Path.home() / ".cache" / "qwen35-fast-ci")
    root = cache / f"triton-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    if not (root / "triton" / "__init__.py").exists():
        wheels = cache / "wheels"
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              f"triton=={version}", "-d", str(wheels)], capture_output=True, text=True)
        found = sorted(wheels.glob(f"triton-{version}-cp{sys.version_info[0]}{sys.version_info[1]}-*.whl"))
        if got.returncode or not found:
            pytest.skip(f"no Triton {version} wheel for this Python here: {got.stderr.strip()[-300:]}")
        part = root.parent / f"{root.name}.part"
        with zipfile.ZipFile(found[-1]) as whl:
            for info in whl.infolist():  # with each file's mode: ptxas must stay executable
                path = whl.extract(info, part)
                if info.external_attr >> 16:
                    os.chmod(path, (info.external_attr >> 16) & 0o777)
        part.rename(root)  # whole or absent: an interrupted unpack is redone
    return root


@pytest.fixture(scope="module")
def old_triton() -> Path:
    return _unpacked_triton(OLD_TRITON)


def _split(result: dict) -> tuple[list[dict], list[dict]]:
    """(the step's calls, the calls that must fail)."""
    step = [c for c in result["calls"] if not c["call"].endswith("explicit config past the limit")]
    checks = [c for c in result["calls"] if c["call"].endswith("explicit config past the limit")]
    return step, checks


def _assert_check_live(result: dict) -> None:
    """Every explicit config past the limit failed with Triton's OutOfResources."""
    _, checks = _split(result)
    assert checks, "consumer_step.py made no check call"
    for c in checks:
        assert c["error"] and c["error"].startswith("OutOfResources"), (c["call"], c["error"], c["launches"])


def _assert_step_fits(result: dict, cc: int, shared: int) -> None:
    """No call of the step failed, each launched Triton kernels, and every launch fits ``shared``."""
    step, _ = _split(result)
    failed = [(c["call"], c["error"]) for c in step if c["error"]]
    assert not failed, f"Triton {result['triton']}, sm_{cc}: " + "\n".join(f"{n}: {e}" for n, e in failed)
    for c in step:
        assert c["launches"], f"{c['call']}: no Triton kernel launched (a torch path was taken)"
        for launch in c["launches"]:
            assert launch["shared"] <= shared, (c["call"], launch)


@pytest.mark.parametrize("name", list(GPUS))
def test_the_shared_memory_check_is_live(compiled, name):
    """A launch config given explicitly is never shrunk; one that needs more shared memory than
    the GPU has must fail with Triton's OutOfResources, or the rest of this file proves nothing."""
    _assert_check_live(compiled[name])


@pytest.mark.parametrize("name", list(GPUS))
def test_every_decode_kernel_launches_within_the_gpus_shared_memory(compiled, name):
    cc, shared, _, _ = GPUS[name]
    _assert_step_fits(compiled[name], cc, shared)


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


def test_the_4bit_register_tile_compiles_for_a_consumer_gpu(compiled):
    """The 4-bit tensor-core register tile (``gemv4m.py``: PTX ``mma.sync``, packed 16-bit FMAs,
    cache-hinted vector loads) goes through ptxas for sm_89: both formats, both step widths, 1 and 4
    rows."""
    calls = [c for c in compiled["sm_89 4-bit"]["calls"] if "register tile" in c["call"]]
    assert len(calls) == 8, [c["call"] for c in calls]
    for c in calls:
        assert c["error"] is None and [x["kernel"] for x in c["launches"]] == ["gemv4m_kernel"], c


@pytest.mark.parametrize("name", list(GPUS))
def test_the_int8_deltanet_inputs_run_as_picked_at_every_row_count(compiled, name):
    """The int8 file's largest grouped product (bf16 activations, ComfyUI's default) fits the GPU
    as picked at 1, 4 and 8 rows: the verify's tiles, which need more shared memory than a consumer
    GPU gives a block, are picked only where they fit, so a consumer GPU runs the tiles it was
    measured with, not fewer stages of them."""
    step, _ = _split(compiled[name])
    calls = [c for c in step if c["call"].endswith(": DeltaNet inputs") and c["call"].startswith("bfloat16 int8 ")]
    cells = [cell for cell in GPUS[name][2] if cell == ["bfloat16", "int8"]]
    assert len(calls) == len(cells) * len(GPUS[name][3])
    for c in calls:
        (launch,) = c["launches"]
        assert launch["stages"] == c["picked"][3], (c["call"], c["picked"], launch)


def test_an_old_triton_compiles_the_step_without_k_slices(old_triton):
    """Triton 3.0-3.2 cannot compile the K-sliced tile the int8 DeltaNet inputs and q/k/v pick on
    3.3+ (3.2's compiler aborts the process). Under torch 2.6's Triton the step picks unsliced tiles
    for them, says so once, and every kernel launches within a consumer GPU's shared memory."""
    result = _result(f"Triton {OLD_TRITON}", _run_step(
        {"cc": 89, "shared": CONSUMER, "cells": [["bfloat16", "int8"]], "rows": [1, 4]}, str(old_triton)))
    assert result["triton"] == OLD_TRITON
    _assert_check_live(result)
    _assert_step_fits(result, 89, CONSUMER)
    step, _ = _split(result)
    grouped = [c for c in step if c["call"].endswith(("DeltaNet inputs", "q/k/v"))]
    assert len(grouped) == 4 and all(len(c["picked"]) == 4 for c in grouped), grouped
    said = [w for w in result["warnings"] if "cannot compile K-sliced GEMV tiles" in w]
    assert len(said) == 1 and f"Triton {OLD_TRITON}" in said[0], result["warnings"]


def test_torch_2_8s_triton_compiles_the_step_with_overlapped_launches():
    """Under torch 2.8's Triton (3.4.0), on a GPU with programmatic dependent launch (an RTX 50, as
    on an H100 / H200), every kernel of the step compiles with its ``griddepcontrol`` instructions
    and launches within the GPU's shared memory."""
    root = _unpacked_triton(PDL_TRITON)
    result = _result(f"Triton {PDL_TRITON}", _run_step(
        {"cc": 120, "shared": CONSUMER, "cells": [["bfloat16", "int8"]], "rows": [1]}, str(root)))
    assert result["triton"] == PDL_TRITON and result["pdl"] is None, result["pdl"]
    _assert_check_live(result)
    _assert_step_fits(result, 120, CONSUMER)


def test_torch_2_11s_triton_compiles_the_4bit_register_tile():
    """Under torch 2.10 / 2.11's Triton (3.6.0) the 4-bit register tile (inline PTX taking the
    weights' and x's addresses beside float accumulators) compiles for an H100 / H200 at an MTP-3
    verify's 4 rows, both formats, both x dtypes, and the rest of the 4-bit step with it."""
    root = _unpacked_triton(ASM_TRITON)
    result = _result(f"Triton {ASM_TRITON}", _run_step(
        {"cc": 90, "shared": HOPPER, "cells": [["bfloat16", "w4a4"], ["float16", "nvfp4"]], "rows": [4]}, str(root)))
    assert result["triton"] == ASM_TRITON
    _assert_check_live(result)
    _assert_step_fits(result, 90, HOPPER)
    calls = [c for c in result["calls"] if "register tile" in c["call"]]
    assert len(calls) == 4, [c["call"] for c in calls]
    for c in calls:
        assert c["error"] is None and [x["kernel"] for x in c["launches"]] == ["gemv4m_kernel"], c
