"""The shipped UI workflows in ComfyUI's real frontend (the tree's own frontend package), in headless
Chromium (Debian's ``chromium``) driven by Playwright's Python client, against a real ComfyUI server.

Per workflow: every node type is registered, no pack node carries an error mark, no two nodes
overlap (a Note never covers a node), and the frontend's error marks fall only on the image half's
core loaders (whose model files a test machine lacks). The prompt enhancer's sampling widgets are
hidden under the official presets and shown under ``custom`` (``web/qwen35_fast.js``), and hiding
them keeps every widget value in place. Skipped where Chromium or Playwright is missing
(``scripts/comfyui_trees.sh`` installs Playwright into the ComfyUI venv where Chromium exists).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import urllib.request
from pathlib import Path

import pytest

from tests.comfyui.test_comfyui_integration import (
    COMFY,
    PACK_DIR_NAME,
    ROOT,
    SHIPPED_PE,
    _example_png,
    _python,
    running_comfyui,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
IMAGE_HALF = {"UNETLoader", "CLIPLoader", "VAELoader"}  # core loaders of Qwen-Image files a test lacks
SAMPLING = ["temperature", "top_k", "top_p", "min_p", "presence_penalty"]

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt install chromium)"),
]

GRAPH_STATE = """() => {
  const g = window.app.graph;
  return (g._nodes || g.nodes).map((n) => ({
    id: n.id, type: n.type, title: n.title, errors: Boolean(n.has_errors),
    registered: Boolean(LiteGraph.registered_node_types[n.type]),
    box: [n.pos[0], n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT, n.size[0], n.size[1] + LiteGraph.NODE_TITLE_HEIGHT],
    widgets: (n.widgets || []).map((w) => ({name: w.name, value: w.value, hidden: Boolean(w.hidden)})),
  }));
}"""

SET_PRESET = """([id, value]) => {
  const n = window.app.graph.getNodeById(id);
  const w = n.widgets.find((w) => w.name === "preset");
  w.value = value;
  w.callback?.(value);
}"""


def _empty_safetensors(path: Path) -> None:
    header = b"{}"
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@contextlib.contextmanager
def frontend_page(comfy: Path, base: Path, chromium: str, sync_api):
    """A real ComfyUI on the tree ``comfy`` (base directory ``base``, filled here: the pack alone, the
    enhancer files listed as on a user's disk, ComfyUI's example picture) and a headless Chromium page
    (1600x1000, Playwright's ``sync_api``) with its frontend loaded and no first-run template gallery;
    the page's uncaught errors collect in ``page.page_errors``. The test below and
    ``scripts/screenshots.py`` both use it."""
    te = base / "models" / "text_encoders"
    te.mkdir(parents=True)
    for name in SHIPPED_PE:  # listed by the loaders as on a user's disk; nothing is generated here
        _empty_safetensors(te / name)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_DIR_NAME).symlink_to(ROOT)
    (base / "input").mkdir()
    _example_png(comfy, base / "input" / "example.png")  # the picture ComfyUI ships, which pe_edit names
    env = dict(os.environ, QWEN35_FAST_COMFYUI_PYTHON=_python(comfy))
    with running_comfyui(comfy, base, env) as srv:
        req = urllib.request.Request(f"{srv.base}/settings/Comfy.TutorialCompleted", data=b"true", method="POST")
        urllib.request.urlopen(req, timeout=30).close()  # no first-run template gallery over the canvas
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            tab = browser.new_page(viewport={"width": 1600, "height": 1000})
            tab.page_errors = []
            tab.on("pageerror", lambda exc: tab.page_errors.append(str(exc)))
            tab.goto(srv.base, wait_until="networkidle")
            tab.wait_for_function("window.app && window.app.graph", timeout=120_000)
            try:
                yield tab
            finally:
                browser.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright (pip install playwright)")
    with frontend_page(Path(COMFY).resolve(), tmp_path_factory.mktemp("frontend_base"), CHROMIUM, sync_api) as tab:
        yield tab


def _load(page, path: Path) -> list[dict]:
    page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(path.read_text()))
    page.wait_for_timeout(1500)
    return page.evaluate(GRAPH_STATE)


def _overlap(a, b) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_workflow_loads_clean(page, path):
    nodes = _load(page, path)
    assert len(nodes) == len(json.loads(path.read_text())["nodes"])
    missing = [n["type"] for n in nodes if not n["registered"]]
    assert not missing, f"node types the frontend does not know: {missing}"
    marked = [f"{n['type']} ({n['title']})" for n in nodes if n["errors"] and n["type"] not in IMAGE_HALF]
    assert not marked, f"nodes marked with errors: {marked}"
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            assert not _overlap(a["box"], b["box"]), f"{a['title']} {a['box']} overlaps {b['title']} {b['box']}"
    assert not page.page_errors, page.page_errors
    # the saved view shows the graph's top-left node below the tabs and the canvas menu, right of the sidebar
    x, y = page.evaluate("""() => {
      const ds = window.app.canvas.ds, g = window.app.graph, nodes = g._nodes || g.nodes;
      const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1]));
      return [(x0 + ds.offset[0]) * ds.scale, (y0 - LiteGraph.NODE_TITLE_HEIGHT + ds.offset[1]) * ds.scale];
    }""")
    assert x >= 60 and y >= 90, (x, y)


@pytest.mark.parametrize("path", [p for p in WORKFLOWS if "pe_" in p.stem], ids=lambda p: p.stem)
def test_sampling_widgets_only_with_preset_custom(page, path):
    nodes = _load(page, path)
    enhancer = next(n for n in nodes if n["type"] == "Qwen35FastPromptEnhancer")
    shipped = {w["name"]: w for w in enhancer["widgets"]}
    assert shipped["preset"]["value"] != "custom"
    assert all(shipped[name]["hidden"] for name in SAMPLING), shipped
    assert not any(w["hidden"] for w in enhancer["widgets"] if w["name"] not in SAMPLING)
    for preset, hidden in (("custom", False), ("edit", True), ("custom", False)):
        page.evaluate(SET_PRESET, [enhancer["id"], preset])
        now = next(n for n in page.evaluate(GRAPH_STATE) if n["id"] == enhancer["id"])
        assert [w["hidden"] for w in now["widgets"] if w["name"] in SAMPLING] == [hidden] * len(SAMPLING), preset
    # hidden or shown, every widget keeps its value (a saved workflow's widgets_values stay in place)
    values = {w["name"]: w["value"] for w in now["widgets"] if w["name"] != "preset"}
    assert values == {name: w["value"] for name, w in shipped.items() if name != "preset"}


def test_a_new_server_enhancer_follows_its_preset_too(page):
    """The server enhancer, added from the node list (not in a shipped workflow): the same rule."""
    node_id = page.evaluate("""() => {
      const n = LiteGraph.createNode("Qwen35FastPromptEnhancerServer");
      window.app.graph.add(n);
      return n.id;
    }""")
    node = next(n for n in page.evaluate(GRAPH_STATE) if n["id"] == node_id)
    assert [w["hidden"] for w in node["widgets"] if w["name"] in SAMPLING] == [True] * len(SAMPLING)
    page.evaluate(SET_PRESET, [node_id, "custom"])
    node = next(n for n in page.evaluate(GRAPH_STATE) if n["id"] == node_id)
    assert [w["hidden"] for w in node["widgets"] if w["name"] in SAMPLING] == [False] * len(SAMPLING)
