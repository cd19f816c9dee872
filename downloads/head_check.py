"""The whole check of a downloaded MTP head file, before it is renamed into place and whenever it
is reused: the pack's header rules (``safetensors_header``), safetensors' own parser
(``safe_open``), exactly the expected ``mtp.*`` names and shapes in float dtypes, finite values,
and the sha256 of its data section recorded in its ``__metadata__`` when it was written
(``data_sha256``: the bytes as received, for a head fetched by range reads, whose metadata then also
says in ``data_checked`` what those bytes were checked for; see ``mtp_fetch``).
"""

from __future__ import annotations

import hashlib
import os
import struct

from .hub_client import MIB, FetchError
from .safetensors_header import local_header, tensor_shapes

FLOAT_DTYPES = ("F16", "BF16", "F32")
SHA_KEY = "data_sha256"      # __metadata__ key holding the hex sha256 of the data section
SHA_PLACEHOLDER = "0" * 64   # written first, replaced in place once the data is verified
CHECKED_KEY = "data_checked"  # __metadata__ key: what the bytes behind data_sha256 were checked for
#: ``CHECKED_KEY`` of a head fetched by range reads (the Hub's sha256 covers whole shards only)
RANGES_CHECKED = ("range reads: Content-Range, sizes, the shard headers, shapes and finite values; not the Hub's "
                  "sha256, which covers whole shards")


MTP_PREFIXES = ("mtp.", "model.mtp.")  # an MTP head's tensor names (base repositories: mtp.*)
_HAS_MTP: dict[str, tuple[tuple[int, int], bool]] = {}  # path -> ((size, mtime_ns), answer)


def has_mtp_tensors(path: str) -> bool:
    """True when the file at ``path`` is a safetensors file whose header names ``mtp.*`` tensors
    (the header only is read; the answer is cached per path, size and mtime). Anything else (another
    format, an unreadable or corrupt file) is False: it is simply not offered as an MTP head."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (st.st_size, st.st_mtime_ns)
    cached = _HAS_MTP.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    answer = False
    if path.endswith(".safetensors"):
        try:
            answer = any(name.startswith(MTP_PREFIXES) for name in local_header(path))
        except FetchError:
            answer = False
    _HAS_MTP[path] = (key, answer)
    return answer


def data_start(path: str) -> int:
    """Byte offset of the data section (after the 8-byte length and the header)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def data_sha256(path: str) -> str:
    """Hex sha256 of the data section of a safetensors file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(data_start(path))
        while block := f.read(16 * MIB):
            digest.update(block)
    return digest.hexdigest()


def record_sha256(path: str, expected: str | None = None) -> None:
    """Write the data section's sha256 over the header's placeholder (same length, so in place);
    with ``expected`` (the hex sha256 of the bytes meant to be there), FetchError unless the data
    section is exactly those bytes."""
    start = data_start(path)
    digest = data_sha256(path)
    if expected is not None and digest != expected:
        raise FetchError(f"The data in {os.path.basename(path)} differs from the bytes received (written over "
                         "while it was downloaded, or a failing disk); it was removed, run again.")
    with open(path, "r+b") as f:
        raw = f.read(start)
        at = raw.find(f'"{SHA_KEY}":"{SHA_PLACEHOLDER}"'.encode())
        if at < 0:
            raise FetchError(f"{os.path.basename(path)} has no {SHA_KEY} placeholder; delete it and run again.")
        f.seek(at + len(f'"{SHA_KEY}":"'))
        f.write(digest.encode())


def source_unchecked(path: str) -> str | None:
    """What the bytes of the head at ``path`` were checked for, when that is less than the Hub's sha256:
    the ``CHECKED_KEY`` text of a head fetched by range reads (``RANGES_CHECKED`` also for one such
    head written before that key, known by its ``source_files``; its values may differ from the
    Hub's file); None for a head written from complete local files (``tools/extract_mtp_head.py``)
    or one whose header cannot be read."""
    try:
        meta = local_header(path).get("__metadata__", {})
    except FetchError:
        return None
    if CHECKED_KEY not in meta and "source_files" in meta:  # fetched by range reads before data_checked existed
        return RANGES_CHECKED
    return meta.get(CHECKED_KEY)


def check_head(path: str, *, shapes: dict | None, finite: bool, fix: str) -> None:
    """FetchError ending in ``fix`` unless ``path`` is a head with exactly ``shapes`` (``mtp.*`` name ->
    shape; None: any ``mtp.*`` tensors) in float dtypes, readable by safetensors, whose data matches
    its recorded sha256 (and, with ``finite``, whose values are all finite)."""
    where = os.path.basename(path)
    try:
        header = local_header(path)
    except FetchError as exc:
        raise FetchError(f"{exc} {fix}") from exc
    got = tensor_shapes(header)
    if shapes is None:
        shapes = {k: v for k, v in got.items() if k.startswith("mtp.")}
    extra = sorted(set(got) - set(shapes))
    if extra:
        raise FetchError(f"{where} holds {extra[0]!r}, which is not part of this model's MTP head. {fix}")
    for name, shape in shapes.items():
        if name not in got:
            raise FetchError(f"{where} lacks {name!r}, which this Qwen3.5 model's MTP head needs. {fix}")
        if got[name] != tuple(shape):
            raise FetchError(f"{where}: {name!r} has shape {got[name]}, this model needs {tuple(shape)}: the head is "
                             f"for another Qwen3.5 size. {fix}")
        if header[name]["dtype"] not in FLOAT_DTYPES:
            raise FetchError(f"{where}: {name!r} is stored as {header[name]['dtype']}, not a float dtype "
                             f"({', '.join(FLOAT_DTYPES)}). {fix}")
    recorded = header.get("__metadata__", {}).get(SHA_KEY)
    if recorded is None or recorded == SHA_PLACEHOLDER:
        raise FetchError(f"{where} carries no checksum ({SHA_KEY}): it was not written by a complete download "
                         f"or by tools/extract_mtp_head.py. {fix}")
    if data_sha256(path) != recorded:
        raise FetchError(f"{where} changed since it was written (its data no longer matches the sha256 recorded "
                         f"then). {fix}")
    _safetensors_check(path, list(shapes), finite, fix)


def _safetensors_check(path: str, names: list[str], finite: bool, fix: str) -> None:
    """safetensors' own parser accepts the file; with ``finite``, every value is a finite number."""
    from safetensors import safe_open

    where = os.path.basename(path)
    try:
        with safe_open(path, framework="pt") as f:
            if set(f.keys()) != set(names):
                raise FetchError(f"{where}: safetensors reads other tensor names than its header lists. {fix}")
            if not finite:
                return
            import torch

            for name in names:
                if not bool(torch.isfinite(f.get_tensor(name)).all()):
                    raise FetchError(f"{where}: {name!r} holds NaN or infinite values, so MTP would accept no "
                                     f"draft. {fix}")
    except FetchError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own verdict on the file, whatever its type
        raise FetchError(f"safetensors cannot read {where} ({type(exc).__name__}: {exc}). {fix}") from exc
