"""The file a conversion writes (``convert_4bit``), from the first byte to its name: a part file of its
own (``part_file.create_unique``: ``<out>.<pid>.<n>.part``, created exclusively, never through a
symbolic link), the header, then each tensor's bytes with their sha256 taken as they are written;
then the written file re-opened and compared with what was meant to be written (its size, the
header byte for byte, every tensor's bytes by sha256, and safetensors' own reading of every name,
dtype and shape) before it is linked to its name, which must not exist. Any failure removes the
part file; the caller holds the output's lock (``file_lock.locked``) throughout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

from ..downloads import part_file
from ..downloads.hub_client import MIB, PART, FetchError
from ..downloads.safetensors_header import DTYPE_BYTES
from .convert_checks import ConversionError

log = logging.getLogger(__name__)

#: torch dtype -> safetensors dtype name, for the dtypes this torch has
ST_DTYPES = {getattr(torch, t): s for t, s in (
    ("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F32"), ("float64", "F64"), ("int8", "I8"),
    ("uint8", "U8"), ("int16", "I16"), ("uint16", "U16"), ("int32", "I32"), ("uint32", "U32"), ("int64", "I64"),
    ("uint64", "U64"), ("bool", "BOOL"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))
    if hasattr(torch, t)}


def remove_stale_parts(dst: Path) -> None:
    """Remove part files of ``dst`` left by conversions that were killed (the caller holds the lock,
    so none of them is being written); symbolic links and other names are left alone."""
    own = re.compile(re.escape(dst.name) + r"\.\d+\.\d+" + re.escape(PART) + "$")
    for entry in os.scandir(dst.parent):
        if own.match(entry.name) and entry.is_file(follow_symlinks=False):
            log.info("Removing %s, left by a conversion that did not finish", entry.path)
            part_file.remove(entry.path)


class ConvertedFile:
    """One conversion's output while it is written. ``header`` first, then ``append`` each tensor
    in the header's order, then ``finish`` (verify and publish); ``discard`` on any failure."""

    def __init__(self, dst: Path):
        self.dst = dst
        try:
            path, fd = part_file.create_unique(str(dst))
        except FetchError as exc:
            raise ConversionError(str(exc)) from exc
        self.part = Path(path)
        self._out = os.fdopen(fd, "wb")
        self._prefix = b""
        self._spans: list[tuple[str, str, list[int], int, int]] = []  # name, dtype, shape, begin, end
        self._hashes: dict[str, str] = {}

    def header(self, specs: dict[str, tuple[str, list[int]]], names: list[str], meta: dict[str, str]) -> None:
        """Write the header: tensors ``names`` in this order, each of ``specs[name]`` (dtype, shape)."""
        entries, pos = {"__metadata__": meta}, 0
        for name in names:
            dtype, shape = specs[name]
            size = DTYPE_BYTES[dtype]
            for d in shape:
                size *= d
            entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + size]}
            self._spans.append((name, dtype, list(shape), pos, pos + size))
            pos += size
        raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._prefix = len(raw).to_bytes(8, "little") + raw
        self._write(self._prefix)

    def append(self, name: str, t: torch.Tensor) -> None:
        """Write ``t`` as tensor ``name``, the next one the header lists, after checking it is what the
        header promised; its sha256 is kept for ``finish``."""
        want, dtype, shape = self._spans[len(self._hashes)][:3]
        if name != want:
            raise ConversionError(f"{self.dst.name}: {name} came where the header has {want} (a bug in the "
                                  "converter); nothing was written.")
        if ST_DTYPES.get(t.dtype) != dtype or list(t.shape) != shape:
            raise ConversionError(f"{name}: comfy-kitchen produced {t.dtype} {tuple(t.shape)}, not {dtype} {shape} "
                                  "as planned (an unsupported comfy-kitchen version?); nothing was written.")
        data = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
        self._hashes[name] = hashlib.sha256(data).hexdigest()
        self._write(data)

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._out.write(data)
        except OSError as exc:
            raise ConversionError(f"Cannot write {self.part} ({exc.strerror or exc}); free space on its disk (the "
                                  "4-bit file is about half the int8 file's size) and convert again.") from exc

    def finish(self) -> Path:
        """Flush, verify the written file against what was meant to be written, then give it its name."""
        if len(self._hashes) != len(self._spans):
            raise ConversionError(f"{self.dst.name}: {len(self._hashes)} of {len(self._spans)} tensors written (a "
                                  "bug in the converter); nothing was published.")
        try:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
        except OSError as exc:
            raise ConversionError(f"Cannot write {self.part} ({exc.strerror or exc}); free space on its disk and "
                                  "convert again.") from exc
        self.verify()
        self._publish()
        return self.dst

    def verify(self) -> None:
        """ConversionError unless the part file is exactly the header and tensors written."""
        where = f"{self.part.name} (being written as {self.dst.name})"
        end = len(self._prefix) + (self._spans[-1][4] if self._spans else 0)
        with open(self.part, "rb") as f:
            if os.fstat(f.fileno()).st_size != end:
                raise _changed(where, f"it has {os.fstat(f.fileno()).st_size} bytes, not {end}")
            if f.read(len(self._prefix)) != self._prefix:
                raise _changed(where, "its header differs from the one written")
            for name, _, _, begin, stop in self._spans:
                digest, left = hashlib.sha256(), stop - begin
                while left > 0 and (block := f.read(min(left, 16 * MIB))):
                    digest.update(block)
                    left -= len(block)
                if left or digest.hexdigest() != self._hashes[name]:
                    raise _changed(where, f"the bytes of {name} differ from those written")
        from safetensors import safe_open

        try:
            with safe_open(str(self.part), framework="pt") as f:
                keys = set(f.keys())
                for name, dtype, shape, _, _ in self._spans:
                    sl = f.get_slice(name)
                    if sl.get_dtype() != dtype or list(sl.get_shape()) != shape:
                        raise _changed(where, f"safetensors reads {name} as {sl.get_dtype()} {sl.get_shape()}")
        except ConversionError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own verdict on the file, whatever its type
            raise _changed(where, f"safetensors cannot read it ({type(exc).__name__}: {exc})") from exc
        if keys != {s[0] for s in self._spans}:
            raise _changed(where, "safetensors reads other tensor names than were written")

    def _publish(self) -> None:
        """The part under the name ``dst``, which must not exist (a hard link fails if it does)."""
        appeared = ConversionError(f"{self.dst} appeared while converting; it was left as it is (move or rename it "
                                   "and convert again).")
        try:
            os.link(self.part, self.dst)
        except FileExistsError:
            raise appeared from None
        except OSError:  # no hard links on this filesystem: a checked rename
            if self.dst.exists() or self.dst.is_symlink():
                raise appeared from None
            os.replace(self.part, self.dst)
            return
        self.part.unlink()

    def discard(self) -> None:
        """Close and remove the part file (after any failure or Cancel)."""
        if not self._out.closed:
            try:
                self._out.close()
            except OSError:
                pass
        part_file.remove(str(self.part))


def _changed(where: str, what: str) -> ConversionError:
    return ConversionError(f"{where} is not what was written: {what} (another program wrote to it, or the disk is "
                           "failing). It was removed and nothing was published; convert again.")
