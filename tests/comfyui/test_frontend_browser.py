"""The shipped UI workflows in ComfyUI's real frontend (the tree's own frontend package), in headless
Chromium (Debian's ``chromium``) driven by Playwright's Python client, against a real ComfyUI server.

Per workflow: every node type is registered, no pack node carries an error mark, no two nodes
overlap (a Note never covers a node), and the frontend's error marks fall only on the image half's
core loaders (whose model files a test machine lacks); opened as a template (the frontend fits the
whole graph in view) it is drawn with its text, and the Templates dialog describes it in words of its
own, not its file name. The prompt enhancer's sampling widgets and ``attention`` are hidden under the
official presets and shown under ``custom``, and its image inputs follow the preset (the connected ones
always, one free one more with edit) with every link kept (``web/qwen35_fast.js``). After a real run
(random 0.8B checkpoints) each pack node's first status line is in view under it. Skipped where
Chromium or Playwright is missing (``scripts/comfyui_trees.sh`` installs Playwright into the ComfyUI
venv where Chromium exists).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
import urllib.request
from pathlib import Path

import pytest

from tests.comfyui.test_comfyui_integration import (
    COMFY,
    MTP_FILE,
    PACK_DIR_NAME,
    ROOT,
    SHIPPED_PE,
    STOP_CKPT,
    _build_files,
    _example_png,
    _python,
    running_comfyui,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
IMAGE_HALF = {"UNETLoader", "CLIPLoader", "VAELoader"}  # core loaders of Qwen-Image files a test lacks
SAMPLING = ["temperature", "top_k", "top_p", "min_p", "presence_penalty"]
CUSTOM_ONLY = [*SAMPLING, "attention"]  # the local enhancer's widgets shown only with preset "custom"

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
            tab.base, tab.server = base, srv.base
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
    enhancer = next(n for n in nodes if n["type"].startswith("Qwen35FastPromptEnhancer"))  # local or server
    shipped = {w["name"]: w for w in enhancer["widgets"]}
    custom_only = [name for name in CUSTOM_ONLY if name in shipped]
    assert shipped["preset"]["value"] != "custom" and set(SAMPLING) <= set(custom_only)
    assert all(shipped[name]["hidden"] for name in custom_only), shipped
    assert not any(w["hidden"] for w in enhancer["widgets"] if w["name"] not in custom_only)
    for preset, hidden in (("custom", False), ("edit", True), ("custom", False)):
        page.evaluate(SET_PRESET, [enhancer["id"], preset])
        now = next(n for n in page.evaluate(GRAPH_STATE) if n["id"] == enhancer["id"])
        assert [w["hidden"] for w in now["widgets"] if w["name"] in custom_only] == [hidden] * len(custom_only), \
            preset
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


# ---------------------------------------------------------------------------------------------
# image inputs by preset; templates; status after a run

INPUTS = """(id) => {
  const g = window.app.graph, n = g.getNodeById(id);
  return n.inputs.filter((i) => i.type === "IMAGE").map((i) => {
    const link = i.link == null ? null : (g._links?.get?.(i.link) ?? g.links[i.link]);
    return [i.name, link ? g.getNodeById(link.origin_id).type : null,
            link ? n.inputs[link.target_slot]?.name === i.name : null];
  });
}"""


def _images(page, node_id) -> list:
    """The enhancer's image inputs shown: [name, the type of the node linked to it or None, whether the
    link's target slot is that input]."""
    return [tuple(x) for x in page.evaluate(INPUTS, node_id)]


def _prompt_inputs(page, node_id) -> dict:
    prompt = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    return prompt[str(node_id)]["inputs"]


def test_image_inputs_follow_the_preset_and_keep_their_links(page):
    nodes = _load(page, ROOT / "workflows" / "pe_text_to_image.json")
    pe = next(n["id"] for n in nodes if n["type"] == "Qwen35FastPromptEnhancer")
    assert _images(page, pe) == []  # text-to-image: no image input
    page.evaluate(SET_PRESET, [pe, "edit"])
    assert _images(page, pe) == [("image1", None, None)]  # edit: one to connect
    nodes = _load(page, ROOT / "workflows" / "pe_edit.json")
    pe = next(n["id"] for n in nodes if n["type"] == "Qwen35FastPromptEnhancer")
    assert _images(page, pe) == [("image1", "LoadImage", True), ("image2", None, None)]
    page.evaluate("""(id) => {
      const g = window.app.graph, n = g.getNodeById(id), src = g._nodes.find((x) => x.type === "LoadImage");
      src.connect(0, n, n.inputs.findIndex((i) => i.name === "image2"));
    }""", pe)
    page.wait_for_timeout(300)
    assert _images(page, pe) == [("image1", "LoadImage", True), ("image2", "LoadImage", True),
                                 ("image3", None, None)]
    page.evaluate(SET_PRESET, [pe, "text-to-image"])  # connected inputs stay, with their links
    assert _images(page, pe) == [("image1", "LoadImage", True), ("image2", "LoadImage", True)]
    inputs = _prompt_inputs(page, pe)
    assert inputs["image1"] == inputs["image2"] == ["6", 0] and "image3" not in inputs
    saved = page.evaluate("() => window.app.graph.serialize()")
    page.evaluate("(wf) => window.app.loadGraphData(wf)", saved)
    page.wait_for_timeout(1500)
    assert _images(page, pe) == [("image1", "LoadImage", True), ("image2", "LoadImage", True)]
    assert not page.page_errors, page.page_errors


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_a_template_opens_with_its_text_drawn(page, path):
    """Opened from Templates the frontend fits the whole graph into the canvas; the zoom must stay where
    litegraph still draws node text (its low-quality threshold)."""
    page.evaluate("([wf, name]) => window.app.loadGraphData(wf, true, true, name, {openSource: 'template'})",
                  [json.loads(path.read_text()), path.stem])
    page.wait_for_timeout(1000)
    scale, low = page.evaluate("() => [window.app.canvas.ds.scale, window.app.canvas.low_quality]")
    assert not low and scale >= 0.6, (path.name, scale)


def test_the_templates_dialog_describes_each_workflow(page):
    page.get_by_text("Templates", exact=True).first.click()
    page.get_by_text(PACK_DIR_NAME, exact=True).first.click()
    page.wait_for_timeout(1500)
    cards = page.evaluate("""(names) => names.map((name) => {
      const title = [...document.querySelectorAll("[role=dialog] *")].find(
        (e) => !e.childElementCount && e.textContent.trim() === name);
      return [name, title ? [...title.parentElement.querySelectorAll("*")].filter((e) => !e.childElementCount
        && e !== title).map((e) => e.textContent.trim()) : null];
    })""", [p.stem for p in WORKFLOWS])
    page.keyboard.press("Escape")
    for name, texts in cards:
        assert texts, f"no card for {name}"
        assert name.replace("_", " ") not in texts and any(len(t) > 20 for t in texts), (name, texts)


BUILD_RUN = """([ckpt, head]) => {
  const g = window.app.graph;
  g.clear();
  const add = (type, pos, values) => {
    const n = LiteGraph.createNode(type);
    n.pos = pos;
    g.add(n);
    for (const [k, v] of Object.entries(values)) n.widgets.find((w) => w.name === k).value = v;
    return n;
  };
  const loader = add("Qwen35FastCLIPLoader", [0, 0], {clip_name: ckpt, mtp_head: head});
  const pe = add("Qwen35FastPromptEnhancer", [420, 0], {prompt: "a fox", system_prompt: "Rewrite it.", max_length: 8});
  loader.connect(0, pe, pe.inputs.findIndex((i) => i.name === "clip"));
  pe.connect(0, add("PreviewAny", [840, 0], {}), 0);
  const core = add("CLIPLoader", [0, 640], {clip_name: ckpt, type: "qwen_image"});
  const patch = add("Qwen35FastLengthAwarePatch", [420, 640], {});
  core.connect(0, patch, 0);
  const gen = add("TextGenerate", [840, 640], {prompt: "hi", max_length: 4, sampling_mode: "off"});
  patch.connect(0, gen, gen.inputs.findIndex((i) => i.name === "clip"));
  gen.connect(0, add("PreviewAny", [1260, 640], {}), 0);
  const ds = window.app.canvas.ds;
  ds.scale = 0.75;
  ds.offset = [120, 130];
  window.app.canvas.setDirty(true, true);
  return {loader: loader.id, enhancer: pe.id, patch: patch.id};
}"""

# The first line of a node's status text: its text, and whether the whole line is inside the status
# box (not scrolled, not cut) and the box inside the window.
FIRST_LINE = """(id) => {
  const n = window.app.graph.getNodeById(id);
  const w = n.widgets?.find((w) => w.name === "$$node-text-preview");
  if (!w) return null;
  const first = String(w.value).split("\\n")[0];
  const span = [...document.querySelectorAll(".dom-widget span")].find((s) => s.firstChild?.textContent === first);
  if (!span) return [first, false, "not in the page"];
  const box = span.closest(".overflow-y-auto") || span.parentElement, b = box.getBoundingClientRect();
  const range = document.createRange();
  range.selectNodeContents(span.firstChild);
  const rows = [...range.getClientRects()];
  const inside = box.scrollTop === 0 && b.height > 0 && b.top >= 0 && b.bottom <= window.innerHeight
    && rows.every((r) => r.top >= b.top - 1 && r.bottom <= b.bottom + 1 && r.right <= b.right + 1);
  return [first, inside, [b.top, b.bottom, rows.map((r) => [r.top, r.bottom])]];
}"""


def test_each_nodes_first_status_line_is_in_view_after_a_run(page):
    """A run on random 0.8B checkpoints (the enhancer's ends after a few tokens): the loader, the
    enhancer and the patch node (whose status after core Generate Text's run keeps "MTP off: no head"
    first) each show their first status line whole, inside the status box under the node."""
    import os

    cache = _build_files(Path(os.environ.get("QWEN35_FAST_CACHE", Path.home() / ".cache" / "qwen35_fast_comfyui")))
    te = page.base / "models" / "text_encoders"
    for name in (STOP_CKPT, MTP_FILE):
        if not (te / name).exists():
            (te / name).symlink_to(cache / name)
    ids = page.evaluate(BUILD_RUN, [STOP_CKPT, MTP_FILE])
    page.evaluate("() => window.app.queuePrompt(0, 1)")
    end = time.time() + 900
    while True:
        with urllib.request.urlopen(f"{page.server}/history", timeout=30) as r:
            runs = list(json.load(r).values())
        if runs and runs[-1].get("status", {}).get("completed") is not None:
            break
        assert time.time() < end, "the run did not finish in 15 min"
        time.sleep(2)
    assert runs[-1]["status"]["status_str"] == "success", runs[-1]["status"]
    page.wait_for_timeout(1000)
    shown = {name: page.evaluate(FIRST_LINE, node_id) for name, node_id in ids.items()}
    assert shown["loader"][0] == "MTP on: head " + MTP_FILE.removesuffix(".safetensors"), shown
    assert shown["patch"][0].startswith("MTP off: no head"), shown
    assert shown["enhancer"][0], shown
    for name, (first, inside, where) in shown.items():
        assert inside, f"{name}: {first!r} not wholly in view ({where})"
