"""safetensors headers, checked before any tensor byte is trusted: of a local file (``local_header``)
or of a remote one by two range reads (``remote_header``). A header that is not JSON, an entry
with an unknown dtype or inconsistent offsets, or data shorter than the header says is a
:class:`FetchError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct

from .hub_client import MIB, FetchError, Remote, endpoint, read_bytes

_MAX_HEADER = 100 * MIB    # a safetensors header larger than this is not a real one
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_entries(header: dict, data_size: int | None, where: str) -> None:
    """Every tensor entry has a known dtype, a consistent byte length, and lies inside the data."""
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], [int(s) for s in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FetchError(f"{where}: header entry {name!r} is malformed; the file is corrupt.") from exc
        if dtype not in _DTYPE_BYTES:
            raise FetchError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; the file is corrupt.")
        if e - b != math.prod(shape) * _DTYPE_BYTES[dtype] or b < 0:
            raise FetchError(f"{where}: tensor {name!r} has inconsistent offsets; the file is corrupt.")
        if data_size is not None and e > data_size:
            raise FetchError(f"{where}: tensor {name!r} ends at byte {e} of a {data_size}-byte data section: "
                             "the file is truncated.")


def _parse_header(raw: bytes, where: str) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FetchError(f"{where}: the safetensors header is not valid JSON; the file is corrupt.") from exc
    if not isinstance(header, dict):
        raise FetchError(f"{where}: the safetensors header is not an object; the file is corrupt.")
    return header


def local_header(path: str) -> dict:
    """The JSON header of a local safetensors file (no tensor data read); FetchError when unreadable."""
    where = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FetchError(f"{where} is empty or truncated; delete it and download it again.")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > min(_MAX_HEADER, size - 8):
                raise FetchError(f"{where} has a broken safetensors header; delete it and download it again.")
            header = _parse_header(f.read(n), where)
    except OSError as exc:
        raise FetchError(f"Cannot read {path!r} ({exc}).") from exc
    _check_entries(header, size - 8 - n, where)
    return header


def tensor_shapes(header: dict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(s) for s in v["shape"]) for k, v in header.items() if k != "__metadata__"}


def remote_header(remote: Remote) -> tuple[dict, int]:
    """(header, header length incl. the 8-byte prefix) of a remote safetensors file, by two range reads."""
    where = f"{remote.repo}/{remote.filename}"
    if remote.size < 8:
        raise FetchError(f"{where} on {endpoint()} is {remote.size} bytes: truncated.")
    (n,) = struct.unpack("<Q", read_bytes(remote, 0, 8))
    if n > min(_MAX_HEADER, remote.size - 8):
        raise FetchError(f"{where} on {endpoint()} has a broken safetensors header (length {n} for a "
                         f"{remote.size}-byte file): the file is corrupt or truncated.")
    header = _parse_header(read_bytes(remote, 8, 8 + n), where)
    _check_entries(header, remote.size - 8 - n, where)
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and 8 + n + max(ends) != remote.size:
        raise FetchError(f"{where} on {endpoint()} is {remote.size} bytes but its header describes "
                         f"{8 + n + max(ends)}: the file is truncated or corrupt.")
    return header, 8 + n
