"""Real screenshots of the shipped workflows in ComfyUI's own frontend, for the README and the template gallery.

    QWEN35_FAST_COMFYUI=<ComfyUI tree> <ComfyUI's python> scripts/screenshots.py [NAME ...]

Starts ComfyUI on the tree (its pinned frontend package, the pack alone among custom nodes, the
enhancer files listed as a user has them), opens it in headless Chromium (Debian's ``chromium``)
through Playwright, loads each ``workflows/<name>.json`` (or those NAMEd) under its own name (the tab
shows it), frames the pack's nodes, the nodes feeding them, the text previews and what feeds those,
and writes ``workflows/<name>.png`` (the screenshot, the workflow embedded: dragging it
onto ComfyUI opens the graph) and ``workflows/<name>.jpg`` (the thumbnail ComfyUI's template
gallery shows under Extensions). Needs Playwright and Pillow in ComfyUI's Python
(``scripts/comfyui_trees.sh`` builds such a tree and venv). The error marks on the image half's
core loaders (their model files are not on the machine that takes the pictures) are in the
picture as a user without them sees them; the panel that counts them is closed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from workflow_png import save_with_workflow  # noqa: E402

from tests.comfyui.test_frontend_browser import frontend_page  # noqa: E402

THUMB_WIDTH = 640
# Frames the pack's nodes with the nodes feeding them, and the text previews with the nodes feeding
# them: their bounding box fitted into the canvas area the frontend's bars leave free, at most at 100 %.
FRAME = """([left, top, pad]) => {
  const app = window.app, g = app.graph, ds = app.canvas.ds, nodes = g._nodes || g.nodes;
  const feeding = (n) => (n.inputs || []).filter((i) => i.link != null)
    .map((i) => g.getNodeById((g._links?.get?.(i.link) ?? g.links[i.link]).origin_id));
  const core = nodes.filter((n) => n.type.startsWith("Qwen35Fast") || n.type === "PreviewAny");
  const mine = [...new Set([...core, ...core.flatMap(feeding)])];
  const x0 = Math.min(...mine.map((n) => n.pos[0])) - pad, y0 = Math.min(...mine.map((n) => n.pos[1])) - 30 - pad;
  const x1 = Math.max(...mine.map((n) => n.pos[0] + n.size[0])) + pad;
  const y1 = Math.max(...mine.map((n) => n.pos[1] + n.size[1])) + pad;
  const w = window.innerWidth - left, h = window.innerHeight - top;
  ds.scale = Math.min(1, w / (x1 - x0), h / (y1 - y0));
  ds.offset = [left / ds.scale - x0 + (w / ds.scale - (x1 - x0)) / 2, top / ds.scale - y0];
  app.canvas.setDirty(true, true);
}"""

# One tab, the workflow's own: the tabs of the workflows loaded before it closed.
ONE_TAB = """async () => {
  const store = window.app.extensionManager?.workflow;
  for (const w of [...(store?.openWorkflows ?? [])]) if (w !== store.activeWorkflow) await store.closeWorkflow(w);
}"""

# The panel that counts the image half's missing models ("3 errors found"): its close button, the
# one beside "View details" in the nearest box that holds buttons.
CLOSE_ERROR_COUNT = """() => {
  const text = [...document.querySelectorAll("*")].find((e) => e.childElementCount === 0
                                                           && /errors? found/.test(e.textContent));
  let box = text;
  while (box && !box.querySelector("button")) box = box.parentElement;
  const close = box && [...box.querySelectorAll("button")].find((b) => !/View details/.test(b.textContent));
  close?.click();
  return Boolean(close);
}"""


def main() -> int:
    from PIL import Image
    from playwright import sync_api

    comfy = Path(os.environ["QWEN35_FAST_COMFYUI"]).resolve()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs Chromium (Debian: apt install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        with frontend_page(comfy, Path(tmp), chromium, sync_api) as page:
            names = sys.argv[1:] or [p.stem for p in sorted((ROOT / "workflows").glob("*.json"))]
            for path in [ROOT / "workflows" / f"{name}.json" for name in names]:
                workflow = json.loads(path.read_text())
                page.evaluate("([wf, name]) => window.app.loadGraphData(wf, true, true, name)", [workflow, path.stem])
                page.wait_for_timeout(1500)
                page.evaluate(ONE_TAB)
                page.evaluate(CLOSE_ERROR_COUNT)
                page.evaluate(FRAME, [70, 60, 20])
                page.wait_for_timeout(500)
                shot = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
                save_with_workflow(shot, workflow, path.with_suffix(".png"))
                thumb = shot.resize((THUMB_WIDTH, round(shot.height * THUMB_WIDTH / shot.width)), Image.LANCZOS)
                thumb.save(path.with_suffix(".jpg"), quality=85)
                print(f"wrote {path.with_suffix('.png')} and {path.with_suffix('.jpg')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
