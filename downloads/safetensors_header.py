"""safetensors headers, checked by safetensors' own rules before any tensor byte is trusted: of a
local file (``local_header``) or of a remote one by two range reads (``remote_header``).

The rules (those of ``safetensors``' ``Metadata::validate``): the 8-byte length is at most
``MAX_HEADER`` and fits the file; the header is a JSON object (nesting at most ``MAX_NESTING``
deep); ``__metadata__`` maps strings to strings; every tensor has a known dtype, a shape of
integers >= 0 and two integer ``data_offsets`` whose span is the shape's byte size; sorted by
offset, the tensors tile the data section from 0 without gaps or overlaps and end exactly where
the file ends. Anything else is a :class:`FetchError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct

from .hub_client import FetchError, Remote, endpoint, read_bytes

MAX_HEADER = 100_000_000   # safetensors' own limit on the header length
MAX_NESTING = 8            # a real header nests 3 deep (object / entry / shape)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_span(name: str, entry, where: str) -> tuple[int, int]:
    """``(begin, end)`` of one tensor entry, its fields checked."""
    bad = FetchError(f"{where}: header entry {name!r} is malformed (dtype, integer shape and two integer "
                     "data_offsets expected); the file is corrupt.")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise bad
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad
    if dtype not in DTYPE_BYTES:
        raise FetchError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; the file is corrupt.")
    b, e = offsets
    if b < 0 or e - b != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise FetchError(f"{where}: tensor {name!r} has inconsistent offsets; the file is corrupt.")
    return b, e


def check_header(header: dict, data_size: int, where: str) -> None:
    """Every rule above on a parsed header whose data section holds ``data_size`` bytes."""
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FetchError(f"{where}: __metadata__ must map strings to strings; the file is corrupt.")
    spans = sorted((_entry_span(name, entry, where), name) for name, entry in header.items()
                   if name != "__metadata__")
    pos = 0
    for (b, e), name in spans:
        if b != pos:
            how = "overlaps the tensor before it" if b < pos else f"leaves a gap of {b - pos} bytes before it"
            raise FetchError(f"{where}: tensor {name!r} {how}; the file is corrupt.")
        pos = e
    if pos > data_size:
        raise FetchError(f"{where}: the tensors end at byte {pos} of a {data_size}-byte data section: the file is "
                         "truncated.")
    if pos < data_size:
        raise FetchError(f"{where}: {data_size - pos} bytes follow the last tensor; the file is corrupt.")


def _nesting(raw: bytes) -> int:
    """Deepest ``[`` / ``{`` nesting of JSON text (strings skipped), in one pass without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_NESTING:
                    return deepest
        elif c in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_header(raw: bytes, where: str) -> dict:
    """The header JSON object of ``raw`` (the bytes after the 8-byte length)."""
    if not raw.lstrip(b" ").startswith(b"{") or _nesting(raw) > MAX_NESTING:
        raise FetchError(f"{where}: the safetensors header is not a flat JSON object; the file is corrupt.")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FetchError(f"{where}: the safetensors header is not valid JSON; the file is corrupt.") from exc
    if not isinstance(header, dict):
        raise FetchError(f"{where}: the safetensors header is not an object; the file is corrupt.")
    return header


def local_header(path: str, fix: str = "delete it and download it again") -> dict:
    """The JSON header of a local safetensors file (no tensor data read), checked by the rules above;
    every FetchError names ``path`` and ends with ``fix`` (what the caller's user should do)."""
    where = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FetchError(f"{path} is empty or truncated (not a safetensors file): {fix}.")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > min(MAX_HEADER, size - 8):
                raise FetchError(f"{path} is not a safetensors file, or its header is broken: {fix}.")
            raw = f.read(n)
    except OSError as exc:
        raise FetchError(f"Cannot read {path!r} ({exc.strerror or exc}); check that it exists and can be read."
                         ) from exc
    try:
        header = parse_header(raw, where)
        check_header(header, size - 8 - n, where)
    except FetchError as exc:
        raise FetchError(f"{exc} ({path}: {fix}.)") from exc
    return header


def tensor_shapes(header: dict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(s) for s in v["shape"]) for k, v in header.items() if k != "__metadata__"}


def remote_header(remote: Remote) -> tuple[dict, int]:
    """(header, header length incl. the 8-byte prefix) of a remote safetensors file, by two range reads."""
    where = f"{remote.repo}/{remote.filename} on {endpoint()}"
    if remote.size < 8:
        raise FetchError(f"{where} is {remote.size} bytes: truncated.")
    (n,) = struct.unpack("<Q", read_bytes(remote, 0, 8))
    if n > min(MAX_HEADER, remote.size - 8):
        raise FetchError(f"{where} has a broken safetensors header (length {n} for a {remote.size}-byte file): "
                         "the file is corrupt or truncated.")
    header = parse_header(read_bytes(remote, 8, 8 + n), where)
    check_header(header, remote.size - 8 - n, where)
    return header, 8 + n
