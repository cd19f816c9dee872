"""A UI-format workflow as a PNG with the workflow embedded, the way ComfyUI saves images.

    python scripts/workflow_png.py workflows/*.json     # writes workflows/<name>.png beside each

An existing PNG keeps its picture (``scripts/screenshots.py`` takes real ones) and gets the
workflow embedded again; a missing one (or ``--redraw``) gets the graph drawn here.

The picture shows the nodes (title, widget values, sockets) and links; the PNG carries the workflow
JSON in a ``workflow`` text chunk (ComfyUI's SaveImage writes the same key), so dragging the PNG
onto ComfyUI opens the graph. Needs Pillow (ComfyUI installs it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TYPE_COLORS = {"CLIP": (255, 210, 77), "STRING": (119, 204, 119), "IMAGE": (100, 181, 246), "INT": (180, 180, 255),
               "MODEL": (180, 130, 255), "VAE": (255, 99, 99), "CONDITIONING": (255, 160, 60),
               "LATENT": (255, 140, 200), "BOOLEAN": (140, 200, 200), "MASK": (120, 220, 180)}
TITLE_H, ROW_H, PAD = 30, 22, 40


def _font(size: int):
    from PIL import ImageFont

    for name in ("DejaVuSans.ttf", "Arial.ttf", "arial.ttf"):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    return ImageFont.load_default()


def _rows(node: dict) -> list[str]:
    rows = [f"o {i['name']}" for i in node.get("inputs", []) if "widget" not in i]
    names = [i["name"] for i in node.get("inputs", []) if "widget" in i]
    rows += [f"o {n}" for n in names]
    rows += [_short(v) for v in node.get("widgets_values", []) if not isinstance(v, (dict, list))]
    return rows


def _short(value, width: int = 46) -> str:
    text = str(value).replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _size(node: dict) -> tuple[int, int]:
    w = max(int(node.get("size", [360, 160])[0]), 300)
    n = max(len(_rows(node)), len(node.get("outputs", [])))
    return w, TITLE_H + ROW_H * n + 12


def render(workflow: dict):
    """A Pillow image of ``workflow`` (UI format)."""
    from PIL import Image, ImageDraw

    nodes = workflow["nodes"]
    boxes = {}
    for n in nodes:
        w, h = _size(n)
        boxes[n["id"]] = (int(n["pos"][0]), int(n["pos"][1]), w, h)
    x0 = min(b[0] for b in boxes.values()) - PAD
    y0 = min(b[1] for b in boxes.values()) - PAD
    x1 = max(b[0] + b[2] for b in boxes.values()) + PAD
    y1 = max(b[1] + b[3] for b in boxes.values()) + PAD
    img = Image.new("RGB", (x1 - x0, y1 - y0), (32, 32, 32))
    draw = ImageDraw.Draw(img)
    font, bold = _font(13), _font(15)
    by_id = {n["id"]: n for n in nodes}

    def out_xy(nid, slot):
        x, y, w, _ = boxes[nid]
        return x - x0 + w, y - y0 + TITLE_H + ROW_H * slot + ROW_H // 2

    def in_xy(nid, name):
        x, y, _, _ = boxes[nid]
        inputs = [i["name"] for i in by_id[nid].get("inputs", []) if "widget" not in i]
        inputs += [i["name"] for i in by_id[nid].get("inputs", []) if "widget" in i]
        row = inputs.index(name) if name in inputs else 0
        return x - x0, y - y0 + TITLE_H + ROW_H * row + ROW_H // 2

    for n in nodes:  # nodes first, links on top (as the frontend draws them)
        x, y, w, h = boxes[n["id"]]
        x, y = x - x0, y - y0
        draw.rounded_rectangle([x, y, x + w, y + h], radius=8, fill=(53, 53, 53), outline=(20, 20, 20))
        draw.rounded_rectangle([x, y, x + w, y + TITLE_H], radius=8, fill=(34, 34, 34))
        draw.text((x + 10, y + 7), n.get("title") or n["type"], fill=(230, 230, 230), font=bold)
        for r, text in enumerate(_rows(n)):
            draw.text((x + 14, y + TITLE_H + ROW_H * r + 3), text, fill=(200, 200, 200), font=font)
        for s, out in enumerate(n.get("outputs", [])):
            ox, oy = out_xy(n["id"], s)
            draw.text((ox - 14 - draw.textlength(out["name"], font=font), oy - 8), out["name"], fill=(200, 200, 200),
                      font=font)
    for link in workflow.get("links", []):
        _, src, slot, dst, dst_slot, typ = link[:6]
        target = by_id[dst]["inputs"][dst_slot]["name"]
        (ax, ay), (bx, by) = out_xy(src, slot), in_xy(dst, target)
        color = TYPE_COLORS.get(typ, (170, 170, 170))
        pts = []
        for i in range(41):
            t = i / 40
            cx1, cx2 = ax + max(60, (bx - ax) / 2), bx - max(60, (bx - ax) / 2)
            px = (1 - t) ** 3 * ax + 3 * (1 - t) ** 2 * t * cx1 + 3 * (1 - t) * t ** 2 * cx2 + t ** 3 * bx
            py = (1 - t) ** 3 * ay + 3 * (1 - t) ** 2 * t * ay + 3 * (1 - t) * t ** 2 * by + t ** 3 * by
            pts.append((px, py))
        draw.line(pts, fill=color, width=3)
        for px, py in ((ax, ay), (bx, by)):
            draw.ellipse([px - 5, py - 5, px + 5, py + 5], fill=color)
    return img


def save_with_workflow(image, workflow: dict, out: Path) -> Path:
    """``image`` (Pillow) saved as the PNG ``out`` with ``workflow`` in its ``workflow`` text chunk."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("workflow", json.dumps(workflow, ensure_ascii=False, separators=(",", ":")))
    image.save(out, pnginfo=info, optimize=True)
    return out


def write_png(workflow_path: Path, out: Path | None = None, *, redraw: bool = False) -> Path:
    """The workflow's PNG with the workflow embedded. An existing PNG keeps its picture (the real
    screenshot ``scripts/screenshots.py`` takes) and gets the current workflow; a missing one (or
    ``redraw``) gets the drawn graph."""
    from PIL import Image

    workflow = json.loads(workflow_path.read_text(encoding="utf-8"))
    out = out or workflow_path.with_suffix(".png")
    if out.exists() and not redraw:
        with Image.open(out) as old:
            picture = old.convert("RGB")
    else:
        picture = render(workflow)
    return save_with_workflow(picture, workflow, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workflows", nargs="+", type=Path, help="UI-format workflow JSON files")
    ap.add_argument("--redraw", action="store_true", help="draw the graph even where a PNG (a screenshot) exists")
    args = ap.parse_args(argv)
    for path in args.workflows:
        print(f"wrote {write_png(path, redraw=args.redraw)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
