"""Copy the MTP head (``mtp.*`` tensors) out of a downloaded Qwen3.5 checkpoint into its own file.

    python <pack>/tools/extract_mtp_head.py <Qwen3.5-9B folder or *.safetensors ...> \\
        ComfyUI/models/text_encoders/qwen3.5_9b_mtp_head.safetensors

For when the checkpoint is already on disk; the loader's ``mtp_head: download (...)`` option fetches
the same tensors alone (about 0.5 GB for 9B) without the rest. Only the ``mtp.*`` entries are read
(safetensors ``safe_open``); ``model.mtp.*`` is folded to ``mtp.*``, the names the loader expects.
The sha256 of the data section is recorded in the header's ``__metadata__`` (``data_sha256``, as
the download records it; the loader re-checks it). The output is written to ``<output>.part`` and
renamed when complete. Needs only ``safetensors``
and ``torch``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("extract_mtp_head")
SHA_KEY = "data_sha256"  # the sha256 of the data section, which the loader re-checks (downloads/head_check.py)
PLACEHOLDER = "0" * 64


def shards(inputs: list[str]) -> list[Path]:
    """The .safetensors files named by ``inputs`` (folders are searched, not recursively)."""
    out = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.safetensors"))
            if not found:
                raise SystemExit(f"{p} holds no .safetensors files; pass the Qwen3.5 checkpoint folder")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"{p} does not exist")
    return out


def extract(inputs: list[str], output: str) -> dict:
    """Write the ``mtp.*`` tensors of ``inputs`` to ``output``; return them. SystemExit when there are none."""
    from safetensors import safe_open
    from safetensors.torch import save

    tensors = {}
    for path in shards(inputs):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = key[len("model."):] if key.startswith("model.mtp.") else key
                if name.startswith("mtp."):
                    tensors[name] = f.get_tensor(key)
    if not tensors:
        raise SystemExit("no mtp.* tensors found: pass the original Qwen3.5 checkpoint (e.g. Qwen/Qwen3.5-9B), "
                         "not a Comfy-Org prompt-enhancer file")
    source = "mtp.* tensors of " + ", ".join(os.path.basename(i) for i in inputs)
    raw = save(tensors, metadata={"source": source, SHA_KEY: PLACEHOLDER})
    start = 8 + int.from_bytes(raw[:8], "little")
    placeholder = f'"{SHA_KEY}":"{PLACEHOLDER}"'.encode()
    digest = f'"{SHA_KEY}":"{hashlib.sha256(memoryview(raw)[start:]).hexdigest()}"'.encode()
    part = output + ".part"
    with open(part, "wb") as f:
        f.write(raw[:start].replace(placeholder, digest, 1))
        f.write(memoryview(raw)[start:])
    os.replace(part, output)
    return tensors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="checkpoint folder(s) or .safetensors shard(s)")
    ap.add_argument("output", help="output .safetensors file, e.g. "
                                   "models/text_encoders/qwen3.5_9b_mtp_head.safetensors")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tensors = extract(args.inputs, args.output)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info("wrote %d tensors (%.0f MiB) to %s", len(tensors), size / 2**20, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
