"""Fetch what the pack needs from the Hugging Face Hub on first use, through ``huggingface_hub``.

Three things, each fetched once and reused offline afterwards:

* the official Qwen-Image 2.1 enhancer system prompts (``system_prompt.txt`` of
  ``Qwen/Qwen-Image-2.1-PE-T2I`` / ``-I2I``; Qwen Research License, never bundled with the pack),
  stored under ComfyUI's models folder;
* the MTP head of a Qwen3.5 base model: only the ``mtp.*`` tensors, read by HTTP range requests
  (``mtp_fetch.py``, over ``hub_client.py`` and ``safetensors_header.py``);
* the Comfy-Org prompt-enhancer files, downloaded whole with progress, resumable, sha256-verified
  (``whole_file.py``).

``huggingface_hub`` is imported lazily (ComfyUI installs it); it supplies the endpoint
(``HF_ENDPOINT``), the token (``HF_TOKEN`` or ``hf auth login``), the cache folder and the HTTP
session. Every failure raises :class:`FetchError` with a message that names the fix.
"""

from __future__ import annotations

import logging
import math
import os

from . import file_lock, part_file
from .hub_client import MIB, FetchError, Progress, endpoint, hub_download
from .mtp_fetch import INDEX_FILE, MTP_BASE_REPOS, fetch_mtp_head
from .safetensors_header import local_header, tensor_shapes
from .transfer import Check
from .whole_file import fetch_whole

__all__ = ["DOWNLOAD", "DOWNLOAD_MATCHING", "INDEX_FILE", "MTP_BASE_REPOS", "PE_FILES", "PE_REPO", "PROMPT_FILE",
           "PROMPT_REPOS", "FetchError", "comfy_check", "comfy_progress", "download_repo", "fetch_mtp_head",
           "fetch_pe_file", "is_download", "mtp_download_options", "mtp_head_for", "official_system_prompt",
           "prompt_path"]

log = logging.getLogger(__name__)

PROMPT_REPOS = {"text-to-image": "Qwen/Qwen-Image-2.1-PE-T2I", "edit": "Qwen/Qwen-Image-2.1-PE-I2I"}
PROMPT_FILE = "system_prompt.txt"
PROMPT_LICENSE = "Qwen Research License (non-commercial use)"
PROMPT_FOLDER = "qwen_image_pe"  # under ComfyUI's models folder

PE_REPO = "Comfy-Org/Qwen-Image-2.1"
PE_SUBFOLDER = "text_encoders"
#: Comfy-Org prompt-enhancer file (about 10 GB each) -> the preset it serves.
PE_FILES = {
    "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors": "text-to-image",
    "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors": "edit",
}

_license_logged: set[str] = set()


# --------------------------------------------------------------------------------------------
# Official system prompts
# --------------------------------------------------------------------------------------------

def prompt_path(preset: str, models_dir: str) -> str:
    """Where the official system prompt of ``preset`` is kept under ComfyUI's models folder."""
    if preset not in PROMPT_REPOS:
        raise ValueError(f"no official system prompt for preset {preset!r}; presets with one: "
                         f"{', '.join(PROMPT_REPOS)}")
    return os.path.join(models_dir, PROMPT_FOLDER, PROMPT_REPOS[preset].split("/")[1], PROMPT_FILE)


def official_system_prompt(preset: str, models_dir: str) -> str:
    """The official system prompt of ``preset``: read from the models folder, fetched there once if absent."""
    path = prompt_path(preset, models_dir)
    repo = PROMPT_REPOS[preset]
    if not os.path.isfile(path):
        _download_prompt(repo, path)
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        raise FetchError(f"{path} is empty; delete it so it is fetched again from {repo}.")
    if repo not in _license_logged:
        _license_logged.add(repo)
        log.info("Qwen3.5 prompt enhancer: official system prompt of %s (%s), from %s", repo, PROMPT_LICENSE, path)
    return text


#: How to go on without the official system prompt file.
OFFLINE_PROMPT = "write a system prompt of your own into the enhancer's system_prompt (instead of 'official')"


def _download_prompt(repo: str, path: str) -> None:
    by_hand = f"hf download {repo} {PROMPT_FILE} --local-dir {os.path.dirname(path)}"
    cached = hub_download(repo, PROMPT_FILE, f"the official system prompt ({repo}/{PROMPT_FILE})", by_hand,
                          offline=OFFLINE_PROMPT)
    try:
        with open(cached, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise FetchError(f"{repo}/{PROMPT_FILE} is not UTF-8 text; report it, or fetch it by hand: {by_hand}") from exc
    if not text.strip():
        raise FetchError(f"{repo}/{PROMPT_FILE} from {endpoint()} is empty; fetch it by hand: {by_hand}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        raise FetchError(f"Cannot create {os.path.dirname(path)} ({exc.strerror or exc}); check the models "
                         "folder's permissions.") from exc
    with file_lock.locked(path):
        if os.path.isfile(path):
            return
        tmp, fd = part_file.create_unique(path)  # O_EXCL: a planted symlink is skipped, never followed
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
            os.replace(tmp, path)
        except BaseException as exc:
            part_file.remove(tmp)
            if isinstance(exc, OSError):
                raise FetchError(f"Cannot write {path} ({exc.strerror or exc}); check the folder's permissions "
                                 "and free space.") from exc
            raise
    log.info("Fetched the official system prompt of %s (%s; not redistributed by this pack) into %s",
             repo, PROMPT_LICENSE, path)
    _license_logged.add(repo)


# --------------------------------------------------------------------------------------------
# Whole files (the Comfy-Org prompt-enhancer checkpoints)
# --------------------------------------------------------------------------------------------

def fetch_pe_file(name: str, dest_dir: str, *, progress: Progress | None = None, check: Check | None = None) -> str:
    """Path of ``dest_dir/name`` (a Comfy-Org prompt-enhancer file), downloaded first if absent.

    Resumable (``<name>.<etag>.part`` is kept after Cancel or a broken connection and continued by
    the next call), one fetch at a time, verified against the Hub's size and sha256 before it is
    renamed into place (``whole_file.fetch_whole``).
    """
    if name not in PE_FILES:
        raise FetchError(f"{name!r} is not a Comfy-Org prompt-enhancer file; known: {', '.join(PE_FILES)}")
    filename = f"{PE_SUBFOLDER}/{name}"
    by_hand = f"hf download {PE_REPO} {filename} --local-dir <ComfyUI>/models"
    return fetch_whole(PE_REPO, filename, os.path.join(dest_dir, name), what=f"{PE_REPO}/{filename} (about 10 GB)",
                       by_hand=by_hand, progress=progress, check=check)


# --------------------------------------------------------------------------------------------
# What the loader node offers
# --------------------------------------------------------------------------------------------

DOWNLOAD = "download ({})"
#: The loader's default ``mtp_head`` choice: the head of the base model of the loaded file's own size.
DOWNLOAD_MATCHING = "download (base model of the same size)"


def mtp_download_options() -> list[str]:
    """Loader ``mtp_head`` choices that fetch the head on first use: the size-matching choice (the
    default), then one per base repository, the 9B enhancer's first."""
    sizes = ["9B", *[s for s in MTP_BASE_REPOS if s != "9B"]]
    return [DOWNLOAD_MATCHING, *[DOWNLOAD.format(MTP_BASE_REPOS[s]) for s in sizes]]


def is_download(option: str) -> bool:
    """True for every ``mtp_head`` choice that downloads (``DOWNLOAD_MATCHING`` or ``download (<repo>)``)."""
    return option == DOWNLOAD_MATCHING or download_repo(option) is not None


def download_repo(option: str) -> str | None:
    """The repository of a ``download (<repo>)`` choice, else None (also for ``DOWNLOAD_MATCHING``)."""
    if option == DOWNLOAD_MATCHING:
        return None
    if isinstance(option, str) and option.startswith("download (") and option.endswith(")"):
        return option[len("download ("):-1]
    return None


def mtp_head_for(option: str, clip_path: str, dest_dir: str, *, progress: Progress | None = None,
                 check: Check | None = None) -> str:
    """Path of the MTP head a ``download (<repo>)`` choice stands for, fetched on first use.

    The size comes from the main checkpoint's tensor shapes (header only), which also give the
    shapes the head must have; ``DOWNLOAD_MATCHING`` takes that size's base repository, and an
    explicit repository of another size is refused, naming the right one.
    """
    from ..engine import Qwen35Config, Qwen35Error

    repo = download_repo(option)
    if repo is None and option != DOWNLOAD_MATCHING:
        raise ValueError(f"{option!r} is not a download choice")
    name = os.path.basename(clip_path)
    try:
        config = Qwen35Config.from_state_dict(tensor_shapes(local_header(clip_path)))
    except Qwen35Error as exc:
        raise FetchError(f"{name}: cannot tell the Qwen3.5 size from its tensors ({exc}).") from exc
    size = config.size_name
    want = MTP_BASE_REPOS.get(size)
    if want is None:
        raise FetchError(f"{name} is not one of the released Qwen3.5 sizes ({', '.join(MTP_BASE_REPOS)}), so no "
                         "base repository holds its MTP head: pick an MTP head file, or 'none'.")
    if repo is not None and want != repo:
        raise FetchError(f"{name} is a Qwen3.5 {size}; its MTP head comes from {want}, not {repo}: pick "
                         f"'{DOWNLOAD.format(want)}'.")
    return fetch_mtp_head(size, dest_dir, expected_shapes=config.mtp_shapes(), progress=progress, check=check)


def comfy_check() -> Check:
    """Raises ComfyUI's interrupt when Cancel was pressed (a download's ``check``; its ``.part`` stays)."""
    def check() -> None:
        try:
            import comfy.model_management as mm
        except ImportError:
            return
        throw = getattr(mm, "throw_exception_if_processing_interrupted", None)
        if throw is not None:
            throw()

    return check


def comfy_progress() -> Progress:
    """A callback driving a ComfyUI progress bar in MiB; checks Cancel at every update."""
    import comfy.utils

    state = {"bar": None, "mib": -1}
    cancelled = comfy_check()

    def update(done: int, total: int) -> None:
        mib_total = max(1, math.ceil(total / MIB))
        if state["bar"] is None:
            state["bar"] = comfy.utils.ProgressBar(mib_total)
        mib = mib_total if done >= total else done // MIB
        if mib != state["mib"]:
            state["mib"] = mib
            state["bar"].update_absolute(min(mib, mib_total), mib_total)
        cancelled()  # Cancel: the .part file stays and the next run resumes it

    return update
