"""GPU, inside a real ComfyUI with DynamicVRAM on (``QWEN35_FAST_COMFYUI=<ComfyUI tree>`` and
comfy-aimdo installed; its own process, since DynamicVRAM is switched on for the whole import):

* a CLIP loaded by core's ``comfy.sd.load_clip`` streams its weights per call: the pack keeps the
  module path for it (no fused kernels, no graphs), says so once with the fix, and its greedy
  tokens equal core's own ``generate`` on the same CLIP;
* the pack's loader (``load_clip(disable_dynamic=True)``) gives a resident CLIP: every projection
  read in place, CUDA graphs on.

main.py switches DynamicVRAM on the same way (``comfy_aimdo.control.init`` and ``init_devices``,
``ModelPatcherDynamic`` as the core patcher); this file does it through the benchmark's
``setup_comfyui(tree, dynamic=True)``.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

from tests.oracles.comfy_tree import GREEDY, log_lines

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run")]



@pytest.fixture(scope="module")
def comfy():
    pytest.importorskip("comfy_aimdo", reason="DynamicVRAM needs comfy-aimdo")
    from benchmarks.comfy_e2e import setup_comfyui

    if "comfy.model_management" in sys.modules:  # comfy-aimdo would find its library unbound
        pytest.fail("ComfyUI was imported without DynamicVRAM earlier in this process; run "
                    "tests/test_comfyui_gpu_dynamic.py in a pytest process of its own")

    try:
        return setup_comfyui(COMFY, dynamic=True)
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, comfy):
    from benchmarks.comfy_e2e import config_08b, write_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "qwen35_08b_int8.safetensors"
    write_checkpoint(path, "int8", config_08b(), "cuda", decisive=True, seed=3)
    return path


def test_core_loaded_dynamic_clip_keeps_module_path_and_says_why(comfy, checkpoint, caplog):
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = comfy.sd.load_clip(ckpt_paths=[str(checkpoint)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE)
    assert clip.patcher.is_dynamic()
    tokens = clip.tokenize("a red kite over a green hill, " * 8)
    caplog.set_level(logging.INFO)
    core = clip.generate(tokens, max_length=16, **GREEDY)
    ours = patch_clip(clip, mtp="off").generate(tokens, max_length=16, **GREEDY)
    assert ours == core
    why = log_lines(caplog, "DynamicVRAM")
    assert why and "--disable-dynamic-vram" in why[0] and "Load Qwen3.5 CLIP" in why[0], why
    path = log_lines(caplog, "decode path")[-1]
    assert "DynamicVRAM" in path and "CUDA graphs off" in path, path


def test_pack_loader_gives_a_resident_clip_on_the_fast_path(comfy, checkpoint, caplog):
    from qwen35_fast.patches.clip_loader import load_qwen35_clip
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = load_qwen35_clip(str(checkpoint), None).clip
    assert not clip.patcher.is_dynamic()
    tokens = clip.tokenize("a red kite over a green hill, " * 8)
    caplog.set_level(logging.INFO)
    core = clip.generate(tokens, max_length=16, **GREEDY)
    ours = patch_clip(clip, mtp="off").generate(tokens, max_length=16, **GREEDY)
    assert ours == core  # decisive weights: the greedy choice has a margin no rounding flips
    path = log_lines(caplog, "decode path")[-1]
    assert "through their module call" not in path and "CUDA graphs on" in path, path
