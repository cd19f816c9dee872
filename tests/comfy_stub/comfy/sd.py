"""Stand-in for ``comfy.sd``: CLIPType and a ``load_clip`` hook tests set to build their fake CLIP."""
from enum import Enum


class CLIPType(Enum):
    STABLE_DIFFUSION = 1
    QWEN_IMAGE = 18


LOADER = None  # tests set: callable(ckpt_paths, clip_type, model_options) -> CLIP
CALLS = []


def load_clip(ckpt_paths, embedding_directory=None, clip_type=CLIPType.STABLE_DIFFUSION, model_options={},
              disable_dynamic=False):
    CALLS.append((list(ckpt_paths), clip_type, dict(model_options)))
    return LOADER(ckpt_paths, clip_type, model_options)
