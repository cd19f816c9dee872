"""Opt-in: multi-image edit prompts (1, 2 and 10 images) through ComfyUI's own tokenizer and
``process_tokens``, compared with an independent Qwen2-VL position rule.

Set ``QWEN35_FAST_COMFYUI=<ComfyUI tree>`` and run with ComfyUI's Python. Only the vision tower is
replaced (by a stand-in that returns one distinct embedding per merged patch of ComfyUI's own image
grid); the tokenizer, ``SDClipModel.process_tokens`` and the MRoPE ids are ComfyUI's. Checked: the
enhancer's chat text puts the images first in the user turn, in order, one vision block each; every
image lands at its ``<|image_pad|>`` with its own size; the pack's positions equal the Qwen2-VL rule
(text sequential; an image of merged grid t x h x w at st gets st + (t, h, w) offsets; text resumes at
st + max(h, w)); more than 10 images, or a prompt naming ``<image3>`` with two images, is refused.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI tree> to run")]

HIDDEN = 16
SYSTEM = "You rewrite image edit instructions."


@pytest.fixture(scope="module")
def comfy():
    loaded = sys.modules.get("comfy")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(Path(COMFY).resolve())):
        pytest.skip("another 'comfy' package (the test stub) is already imported: run this file on its own")
    sys.path.insert(0, COMFY)
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        import comfy.sd1_clip
        import comfy.text_encoders.qwen35
        import comfy.text_encoders.qwen_vl
    except ImportError as exc:
        pytest.skip(f"ComfyUI at {COMFY} cannot be imported here ({exc}); use ComfyUI's Python")
    return comfy


class _Vision(torch.nn.Module):
    """Stand-in tower: ComfyUI's own preprocessing and grid, one embedding per merged 2x2 patch."""

    def __init__(self, qwen_vl):
        super().__init__()
        self.qwen_vl = qwen_vl
        self.embed = torch.nn.Embedding(248320, HIDDEN)
        self.seen = []

    def get_input_embeddings(self):
        embed = self.embed

        def lookup(ids, out_dtype=None):
            out = embed(ids)
            return out if out_dtype is None else out.to(out_dtype)
        return lookup

    def preprocess_embed(self, embed, device):
        image = embed["data"]
        _, grid = self.qwen_vl.process_qwen2vl_images(image, patch_size=16)
        n = int(grid[0].prod()) // 4
        self.seen.append((tuple(image.shape), grid.clone()))
        marker = float(image.reshape(-1)[0])  # each test image is filled with its own value
        return torch.full((n, HIDDEN), marker), grid


def _clip_model(comfy):
    vision = _Vision(comfy.text_encoders.qwen_vl)
    model = types.SimpleNamespace(special_tokens={"pad": 248044}, transformer=vision)
    model.process_tokens = types.MethodType(comfy.sd1_clip.SDClipModel.process_tokens, model)
    return model, vision


def _reference_positions(ids_and_images, grids) -> torch.Tensor:
    """Qwen2-VL's rope index (as in transformers' get_rope_index) for one row."""
    cols, pos, g = [], 0, iter(grids)
    for item in ids_and_images:
        if item == "image":
            t, h, w = (int(x) for x in next(g)[0])
            h, w = h // 2, w // 2
            for ti in range(t):
                for hi in range(h):
                    for wi in range(w):
                        cols.append((pos + ti, pos + hi, pos + wi))
            pos += max(t, h, w)
        else:
            cols.append((pos, pos, pos))
            pos += 1
    return torch.tensor(cols, dtype=torch.long).T


def _images(sizes):
    return [torch.full((1, h, w, 3), (k + 1) / 16) for k, (h, w) in enumerate(sizes)]


@pytest.mark.parametrize("sizes", [[(64, 96)], [(64, 96), (96, 48)], [(32 + 16 * k, 48 + 8 * k) for k in range(10)]],
                         ids=["1", "2", "10"])
def test_multi_image_prompt_and_positions(comfy, sizes):
    from qwen35_fast.enhancer import enhancer_images
    from qwen35_fast.enhancer import prompt_enhancer as pe
    from qwen35_fast.patches import comfy_bridge as bridge

    images = enhancer_images.prepare_images(_images(sizes))
    assert [tuple(i.shape[1:3]) for i in images] == sizes  # small images keep their size
    refs = " and ".join(f"<image{k + 1}>" for k in range(len(sizes)))
    prompt = f"Put the subjects of {refs} into one picture"
    text = pe.chat_text(SYSTEM, prompt, len(images), thinking=True)
    user = text.split("<|im_start|>user\n", 1)[1]
    assert user.startswith(pe.VISION_BLOCK * len(images) + prompt)  # images first, in order, then the text

    tokenizer = comfy.text_encoders.qwen35.Qwen35ImageTokenizer(embedding_directory=None, tokenizer_data={},
                                                                 model_type="qwen35_2b")
    tokens = tokenizer.tokenize_with_weights(text, images=images)
    model, vision = _clip_model(comfy)
    target = types.SimpleNamespace(clip_model=model)
    embeds, positions = bridge.prompt_embeds(target, tokens, torch.device("cpu"))

    grids = [g for _, g in vision.seen]
    assert [s[1:3] for s, _ in vision.seen] == sizes  # every image embedded once, in order
    row = next(iter(tokens.values()))[0]
    layout = ["image" if isinstance(t[0], dict) else "text" for t in row]
    assert layout.count("image") == len(sizes)
    expected = _reference_positions(layout, grids)
    assert positions.shape == expected.shape == (3, embeds.shape[1])
    assert torch.equal(positions, expected)
    # each image's span carries that image's embedding (its fill value), in order
    markers = [float(v) for v in embeds[0, :, 0].detach().unique_consecutive() if float(v) in
               {(k + 1) / 16 for k in range(len(sizes))}]
    assert markers == [(k + 1) / 16 for k in range(len(sizes))]


def test_image_limits(comfy):
    from qwen35_fast.enhancer import enhancer_images as ei

    with pytest.raises(ValueError, match="at most 10 images"):
        ei.prepare_images(_images([(32, 32)] * 11))
    big = ei.prepare_images([torch.zeros(1, 2048, 1536, 3)])[0]  # the reference caps each image at 1 MP
    assert big.shape[1] * big.shape[2] <= 1024 * 1024 and abs(big.shape[2] / big.shape[1] - 0.75) < 0.01
    with pytest.raises(ValueError, match=r"<image3>.*2 images"):
        ei.check_image_references("Blend <image1> with <image3>", 2)
    ei.check_image_references("Blend <image1> with <image2>", 2)
