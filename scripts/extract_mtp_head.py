"""Copy the MTP head (``mtp.*`` tensors) out of a Qwen3.5 checkpoint into its own safetensors file.

    python scripts/extract_mtp_head.py <Qwen3.5-9B folder or *.safetensors ...> \
        ComfyUI/models/text_encoders/qwen3.5_9b_mtp_head.safetensors

The Comfy-Org prompt-enhancer files carry no MTP head; the base model Qwen/Qwen3.5-9B does (about
0.5 GB of its shards). Only the ``mtp.*`` entries are read (safetensors ``safe_open``); names are
kept as they are (``mtp.fc.weight``, ``mtp.layers.0...``), which is what the loader node expects.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def shards(inputs: list[str]) -> list[Path]:
    out = []
    for item in inputs:
        p = Path(item)
        out.extend(sorted(p.glob("*.safetensors")) if p.is_dir() else [p])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="checkpoint folder(s) or .safetensors shard(s)")
    ap.add_argument("output", help="output .safetensors file")
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for path in shards(args.inputs):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = key[len("model."):] if key.startswith("model.mtp.") else key
                if name.startswith("mtp."):
                    tensors[name] = f.get_tensor(key)
    if not tensors:
        print("no mtp.* tensors found: pass the original Qwen/Qwen3.5-9B checkpoint", file=sys.stderr)
        return 1
    save_file(tensors, args.output, metadata={"source": "mtp.* tensors of " + ", ".join(args.inputs)})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({size / 2**20:.0f} MiB) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
