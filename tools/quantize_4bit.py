"""Write a 4-bit copy (ComfyUI's ``convrot_w4a4`` or ``nvfp4`` format) of a Qwen3.5 text-encoder file.

    python <pack>/tools/quantize_4bit.py ComfyUI/models/text_encoders/<name>.int8_convrot.safetensors \\
        --format convrot_w4a4 [--out ComfyUI/models/text_encoders] [--device cpu]

Writes ``<out>/<name>.convrot_w4a4.safetensors`` (or ``.nvfp4``; default folder: the source's), the
same file the "Save Qwen3.5 4-bit" node writes (``patches/convert_4bit.py``: which tensors stay 8/16-bit
and why, the format, streaming, the lock and the verified, atomic publish). Never overwrites. A bad input
exits with status 2 and one line naming the fix. Needs torch, safetensors and comfy-kitchen (ComfyUI's
own quantizers).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.patches import convert_4bit  # noqa: E402

log = logging.getLogger("quantize_4bit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="the Qwen3.5 .safetensors file (int8_convrot or bf16/fp16)")
    ap.add_argument("--format", choices=convert_4bit.FORMATS, default=convert_4bit.FORMATS[0])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the source's)")
    ap.add_argument("--device", default=None, help="where comfy-kitchen quantizes (default: cuda if present)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    errors: dict[str, float] = {}

    def progress(done: int, total: int, key: str) -> None:
        if done % 16 == 0 or done == total:
            log.info("%d / %d  %s", done, total, key)

    try:
        steps = convert_4bit.plan(args.source, args.format)
        out = convert_4bit.convert(args.source, args.out or args.source.parent, args.format, progress=progress,
                                   device=args.device, errors=errors)
    except convert_4bit.ConversionError as exc:
        log.error("%s", exc)
        return 2
    log.info("%s", convert_4bit.summary(out, steps, errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
