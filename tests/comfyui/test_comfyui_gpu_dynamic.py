"""GPU, inside a real ComfyUI with DynamicVRAM on (``QWEN35_FAST_COMFYUI=<ComfyUI tree>`` and
comfy-aimdo installed; its own process, since DynamicVRAM is switched on for the whole import):

* a CLIP loaded by core's ``comfy.sd.load_clip`` streams its weights per call; the patch reloads it
  once through ComfyUI's own ``clone(disable_dynamic=True)`` (``comfy_weights.resident_clip``), so the
  patched CLIP runs with every projection read in place and CUDA graphs on, and its greedy tokens
  equal core's own ``generate`` on the streamed CLIP; a second patch reuses the reload;
* when the model cannot fit the GPU whole, the patched CLIP keeps the streamed module path (no fused
  kernels, no graphs) and says why once;
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
                    "tests/comfyui/test_comfyui_gpu_dynamic.py in a pytest process of its own")

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


def test_core_loaded_dynamic_clip_runs_resident_on_the_fast_path(comfy, checkpoint, caplog):
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = comfy.sd.load_clip(ckpt_paths=[str(checkpoint)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE)
    assert clip.patcher.is_dynamic()
    tokens = clip.tokenize("a red kite over a green hill, " * 8)
    caplog.set_level(logging.INFO)
    core = clip.generate(tokens, max_length=16, **GREEDY)
    patched = patch_clip(clip, mtp="off")
    assert not patched.patcher.is_dynamic() and patched.cond_stage_model is not clip.cond_stage_model
    ours = patched.generate(tokens, max_length=16, **GREEDY)
    assert ours == core  # decisive weights: the greedy choice has a margin no rounding flips
    assert not log_lines(caplog, "streams this model"), log_lines(caplog, "streams this model")
    path = log_lines(caplog, "decode path")[-1]
    assert "through their module call" not in path and "CUDA graphs on" in path, path
    again = patch_clip(clip, mtp="off")
    assert again.cond_stage_model is patched.cond_stage_model  # one reload per model
    assert len(log_lines(caplog, "reloading the model without DynamicVRAM")) == 1
    assert again.generate(tokens, max_length=16, **GREEDY) == core


def test_core_loaded_dynamic_clip_too_big_keeps_module_path_and_says_why(comfy, checkpoint, caplog, monkeypatch):
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = comfy.sd.load_clip(ckpt_paths=[str(checkpoint)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE)
    assert clip.patcher.is_dynamic()
    tokens = clip.tokenize("a red kite over a green hill, " * 8)
    caplog.set_level(logging.INFO)
    core = clip.generate(tokens, max_length=16, **GREEDY)
    with monkeypatch.context() as m:  # a GPU as large as the model: no room for inference beside it
        m.setattr(comfy.model_management, "get_total_memory", lambda *a, **k: clip.patcher.model_size())
        patched = patch_clip(clip, mtp="off")
    assert patched.cond_stage_model is clip.cond_stage_model
    ours = patched.generate(tokens, max_length=16, **GREEDY)
    assert ours == core
    why = log_lines(caplog, "DynamicVRAM")
    assert why and "does not fit whole on this GPU" in why[0], why
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
