"""Every generation entry point of the ComfyUI versions the pack supports is routed on the patched clone.

The fake CLIP of ``test_nodes`` is given the entry points newer ComfyUI has: ``SDClipModel.generate``
with ``mtp=`` (its ``CLIP.generate`` passes it through, so does a ``TextGenerate`` with an ``mtp``
input) and core's private MTP loop ``Qwen35._generate_mtp(embeds, max_length, stop_tokens,
sampling, fixed_depth[, position_ids])``. Each must reach the engine on the clone only, with the
caller's arguments mapped, and an argument no version passes must fail loudly.
"""

from __future__ import annotations

import pytest
import torch

from tests.comfyui.test_nodes import HIDDEN, FakeCLIP, FakeSDClip, FakeTransformer, bridge, clip_patch, scripted  # noqa: F401


class NewerTransformer(FakeTransformer):
    """``Qwen35`` of the FixedKVBias / FixedKVCache generations: core MTP loop beside generate."""

    def generate(self, embeds, *args, mtp=True, **kwargs):
        self.core_calls.append(("generate", mtp))
        return [1, 2, 3]

    def _generate_mtp(self, embeds, max_length, stop_tokens, sampling=None, fixed_depth=None, position_ids=None):
        self.core_calls.append(("_generate_mtp", fixed_depth))
        return [7, 7]


class NewerSDClip(FakeSDClip):
    def __init__(self):
        super().__init__()
        self.transformer = NewerTransformer()

    def generate(self, tokens, do_sample, max_length, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                 presence_penalty=0.0, mtp=True):
        tokens_only = [[t[0] for t in b] for b in next(iter(tokens.values()))]
        embeds = self.process_tokens(tokens_only, self.execution_device)[0]
        return self.transformer.generate(embeds, do_sample, max_length, mtp=mtp)


def newer_clip():
    from types import SimpleNamespace

    return FakeCLIP(csm=SimpleNamespace(clip="qwen35_test", qwen35_test=NewerSDClip()))


MTP_LOOP = "qwen35_test.transformer._generate_mtp"


def test_core_mtp_loop_is_routed_on_the_clone_only(scripted):  # noqa: F811
    eng = scripted("hi")
    clip = newer_clip()
    patched = clip_patch.patch_clip(clip, mtp="auto")
    assert MTP_LOOP in patched.patcher.object_patches and not clip.patcher.object_patches
    loop = patched.patcher.object_patches[MTP_LOOP]
    greedy = loop(torch.zeros(5, HIDDEN), 4, [248046])
    call = eng.calls[-1]
    assert getattr(greedy, "stats", None) is not None and call["do_sample"] is False
    assert call["embeds"].shape == (1, 5, HIDDEN) and call["max_length"] == 4 and call["stop_tokens"] == [248046]
    assert call["mtp"] == "auto"
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 1.5, "seed": 11}
    pos = torch.arange(5).expand(3, 5)
    loop(torch.zeros(1, 5, HIDDEN), 4, None, sampling=sampling, fixed_depth=2, position_ids=pos)
    call = eng.calls[-1]
    assert call["do_sample"] is True and call["mtp"] == 2 and call["seed"] == 11 and call["top_k"] == 20
    assert call["temperature"] == 0.7 and call["presence_penalty"] == 1.5 and call["position_ids"] is pos
    assert clip.cond_stage_model.qwen35_test.transformer.core_calls == []  # core's loop never ran


def test_patch_node_mtp_choice_wins_over_the_core_loop_depth(scripted):  # noqa: F811
    eng = scripted("hi")
    patched = clip_patch.patch_clip(newer_clip(), mtp="off")
    patched.patcher.object_patches[MTP_LOOP](torch.zeros(1, 3, HIDDEN), 2, None, fixed_depth=3)
    assert eng.calls[-1]["mtp"] == "off"


@pytest.mark.parametrize("caller,expect", [(True, "auto"), (False, "off"), (3, 3)])
def test_clip_generate_mtp_argument_is_honoured(scripted, caller, expect):  # noqa: F811
    """``CLIP.generate(..., mtp=)`` / TextGenerate's ``mtp`` input reach the engine under mtp=auto."""
    eng = scripted("hi")
    patched = clip_patch.patch_clip(newer_clip(), mtp="auto")
    fn = patched.patcher.object_patches["qwen35_test.generate"]
    fn(patched.tokenize("a fox"), do_sample=False, max_length=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
       repetition_penalty=1.0, seed=None, presence_penalty=0.0, mtp=caller)
    assert eng.calls[-1]["mtp"] == expect
    emb = patched.patcher.object_patches["qwen35_test.transformer.generate"]
    emb(torch.zeros(1, 3, HIDDEN), False, 3, mtp=caller)
    assert eng.calls[-1]["mtp"] == expect


@pytest.mark.parametrize("entry", ["qwen35_test.generate", "qwen35_test.transformer.generate", MTP_LOOP])
def test_unknown_arguments_fail_loudly_on_the_clone(scripted, entry):  # noqa: F811
    eng = scripted("hi")
    clip = newer_clip()
    patched = clip_patch.patch_clip(clip, mtp="auto")
    fn = patched.patcher.object_patches[entry]
    if entry == "qwen35_test.generate":
        args = (patched.tokenize("a fox"), False, 3, 1.0, 0, 1.0, 0.0, 1.0, None)
    elif entry == MTP_LOOP:
        args = (torch.zeros(1, 3, HIDDEN), 3, None)
    else:
        args = (torch.zeros(1, 3, HIDDEN),)
    with pytest.raises(bridge.Qwen35Unsupported, match="speculative_budget"):
        fn(*args, speculative_budget=4)
    assert eng.calls == []
    if entry == MTP_LOOP:
        with pytest.raises(bridge.Qwen35Unsupported, match="typical_p"):
            fn(*args, sampling={"temperature": 1.0, "typical_p": 0.9})
    # the input CLIP still runs core's own generate
    assert clip.generate(clip.tokenize("a fox"), max_length=3) == [1, 2, 3]


def test_versions_without_a_core_mtp_loop_get_no_extra_patch(scripted):  # noqa: F811
    patched = clip_patch.patch_clip(FakeCLIP(), mtp="auto")
    assert MTP_LOOP not in patched.patcher.object_patches
