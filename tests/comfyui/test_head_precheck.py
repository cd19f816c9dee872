"""The chosen MTP head file is checked from its header before the main checkpoint loads: a wrong head
(shapes of another size, a non-float dtype, a missing tensor) fails naming the file and the fix, and
``comfy.sd.load_clip`` (a spy in tests/comfy_stub) is never called. CPU, tiny files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

STUB = Path(__file__).resolve().parents[1] / "comfy_stub"
if str(STUB) not in sys.path:
    sys.path.insert(0, str(STUB))

import comfy.sd  # noqa: E402
from qwen35_fast.patches import clip_loader, mtp_graft  # noqa: E402

from tests.oracles.tiny import add_mtp, make_tiny, to_layout  # noqa: E402


@pytest.fixture
def files(tmp_path):
    """(main checkpoint without mtp.*, the matching head's tensors) on disk; load_clip spied on."""
    sd, d = make_tiny(3, strength=0.2)
    hf = to_layout(add_mtp(sd, d, 4, noise=0.02, norm_spread=0.05), "hf")
    head = {k: v.contiguous() for k, v in hf.items() if k.startswith("mtp.")}
    save_file({k: v.contiguous() for k, v in hf.items() if k not in head}, str(tmp_path / "main.safetensors"))
    comfy.sd.CALLS.clear()
    comfy.sd.LOADER = lambda paths, clip_type, opts: pytest.fail("load_clip ran for a head the header refuses")
    yield tmp_path, head
    comfy.sd.LOADER = None


def _wrong_size(head):
    return {k: (v[..., :-2].contiguous() if k == "mtp.fc.weight" else v) for k, v in head.items()}


def _int_dtype(head):
    return {k: (v.to(torch.int32) if k == "mtp.norm.weight" else v) for k, v in head.items()}


def _missing(head):
    return {k: v for k, v in head.items() if k != "mtp.pre_fc_norm_hidden.weight"}


@pytest.mark.parametrize("damage,match", [
    (_wrong_size, r"mtp.fc.weight has shape \(\d+, \d+\), the model needs"),
    (_int_dtype, "mtp.norm.weight is stored as I32, not a float dtype"),
    (_missing, "mtp.pre_fc_norm_hidden.weight is missing"),
])
def test_a_wrong_head_fails_before_the_main_checkpoint_loads(files, damage, match):
    tmp, head = files
    save_file(damage(head), str(tmp / "bad_head.safetensors"))
    with pytest.raises(mtp_graft.MTPHeadError, match=match) as err:
        clip_loader.load_qwen35_clip(str(tmp / "main.safetensors"), str(tmp / "bad_head.safetensors"))
    assert "bad_head.safetensors" in str(err.value) and "set mtp_head to 'none'" in str(err.value)
    assert comfy.sd.CALLS == []  # refused from the headers alone


def test_the_right_head_passes_the_header_check(files):
    tmp, head = files
    save_file(head, str(tmp / "head.safetensors"))
    mtp_graft.check_head_header(str(tmp / "head.safetensors"), str(tmp / "main.safetensors"))
