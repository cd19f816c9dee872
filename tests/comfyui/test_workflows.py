"""Every example workflow against the UI workflow format (schema 0.4) and the nodes' schemas.

UI files: a compact check of the 0.4 format (nodes, links, widgets_values), link consistency and
types, widget counts from the pack's own schemas (core nodes from the table below, which the
real-ComfyUI test cross-checks against /object_info), and model file names with download links.
API twins: node types, input names, links and widget values within the schemas' options/ranges.
As shipped: ``<name>.json`` pairs with ``api/<name>_api.json`` and ``<name>.png`` (the workflow in the
PNG's ``workflow`` text chunk, as ComfyUI writes it); official system prompt and max_length; a Note
saying what to download. (The frontend's own schema: tests/comfyui/test_workflow_schema.py.)
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parents[1] / "comfy_stub"
if str(STUB) not in sys.path:
    sys.path.insert(0, str(STUB))

from qwen35_fast.nodes import extension  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UI_FILES = sorted((ROOT / "workflows").glob("*.json"))
API_FILES = sorted((ROOT / "workflows" / "api").glob("*.json"))

# Core nodes used by the examples: widget names in UI order ("+x" = extra UI-only value such as
# control_after_generate), and socket inputs/outputs.
CORE = {
    "CLIPLoader": (["clip_name", "type", "device"], {}, ["CLIP"]),
    "TextGenerate": (["prompt", "max_length", "sampling_mode", "temperature", "top_k", "top_p", "min_p",
                      "repetition_penalty", "seed", "presence_penalty", "thinking", "use_default_template"],
                     {"clip": "CLIP", "image": "IMAGE", "video": "IMAGE", "audio": "AUDIO"}, ["STRING"]),
    "PreviewAny": ([], {"source": "*"}, ["STRING"]),
    "LoadImage": (["image", "+upload"], {}, ["IMAGE", "MASK"]),
    "ImageScale": (["upscale_method", "width", "height", "crop"], {"image": "IMAGE"}, ["IMAGE"]),
    "UNETLoader": (["unet_name", "weight_dtype"], {}, ["MODEL"]),
    "VAELoader": (["vae_name"], {}, ["VAE"]),
    "ModelSamplingAuraFlow": (["shift"], {"model": "MODEL"}, ["MODEL"]),
    "CLIPTextEncode": (["text"], {"clip": "CLIP"}, ["CONDITIONING"]),
    "TextEncodeQwenImageEdit": (["prompt"], {"clip": "CLIP", "vae": "VAE", "image": "IMAGE"}, ["CONDITIONING"]),
    "EmptySD3LatentImage": (["width", "height", "batch_size"], {}, ["LATENT"]),
    "KSampler": (["seed", "+control", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
                 {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING",
                  "latent_image": "LATENT"}, ["LATENT"]),
    "VAEDecode": ([], {"samples": "LATENT", "vae": "VAE"}, ["IMAGE"]),
    "SaveImage": (["filename_prefix"], {"images": "IMAGE"}, []),
    "Note": (["text"], {}, []),  # frontend-only: never in an API twin
}
TEXTGEN_OFF_WIDGETS = 5  # prompt, max_length, sampling_mode, thinking, use_default_template


def pack_specs():
    """node_id -> (widget names incl. '+control', socket inputs {name: type}, output types, schema)."""
    out = {}
    for cls in extension.NODES:
        s = cls.define_schema()
        widgets, sockets = [], {}
        for i in s.inputs:
            if i.widget:
                widgets.append(i.id)
                if getattr(i, "control_after_generate", None):
                    widgets.append("+control")
            else:
                sockets[i.id] = i.io_type
        out[s.node_id] = (widgets, sockets, [o.io_type for o in s.outputs], s)
    return out


def spec(node_type):
    packs = pack_specs()
    if node_type in packs:
        return packs[node_type][:3]
    assert node_type in CORE, f"unknown node type {node_type}"
    return CORE[node_type]


def check_ui_format(wf):
    """Compact schema-0.4 check; returns a list of problems."""
    errs = []
    for key, typ in (("nodes", list), ("links", list), ("version", (int, float)), ("last_node_id", int),
                     ("last_link_id", int)):
        if not isinstance(wf.get(key), typ):
            errs.append(f"top-level {key!r} missing or not {typ}")
    if wf.get("version") != 0.4:
        errs.append(f"version {wf.get('version')} != 0.4")
    for n in wf.get("nodes", []):
        for key, typ in (("id", int), ("type", str), ("pos", list), ("size", list), ("flags", dict),
                         ("order", int), ("mode", int), ("inputs", list), ("outputs", list),
                         ("properties", dict), ("widgets_values", list)):
            if not isinstance(n.get(key), typ):
                errs.append(f"node {n.get('id')}: {key!r} missing or not {typ.__name__}")
        for i in n.get("inputs", []):
            if not isinstance(i.get("name"), str) or not isinstance(i.get("type"), str) or "link" not in i:
                errs.append(f"node {n['id']}: bad input {i}")
        for o in n.get("outputs", []):
            if not isinstance(o.get("name"), str) or not isinstance(o.get("type"), str) or \
                    not isinstance(o.get("links"), (list, type(None))):
                errs.append(f"node {n['id']}: bad output {o}")
    for lk in wf.get("links", []):
        if not (isinstance(lk, list) and len(lk) == 6 and all(isinstance(x, int) for x in lk[:5])
                and isinstance(lk[5], str)):
            errs.append(f"bad link {lk}")
    ids = [n["id"] for n in wf.get("nodes", [])]
    if len(set(ids)) != len(ids) or (ids and wf.get("last_node_id", -1) < max(ids)):
        errs.append("node ids not unique or last_node_id too small")
    return errs


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_format_links_and_widgets(path):
    wf = json.loads(path.read_text())
    assert check_ui_format(wf) == []
    nodes = {n["id"]: n for n in wf["nodes"]}
    for lid, src, slot, dst, dslot, typ in wf["links"]:
        out = nodes[src]["outputs"][slot]
        inp = nodes[dst]["inputs"][dslot]
        assert lid in out["links"] and inp["link"] == lid, f"link {lid} not recorded on both ends"
        assert out["type"] == typ and inp["type"] in (typ, "*"), f"link {lid}: {out['type']} -> {inp['type']}"
        assert spec(nodes[src]["type"])[2][slot] == typ, f"link {lid}: schema output type differs"
    for n in wf["nodes"]:
        widgets, sockets, outputs = spec(n["type"])
        expected = len(widgets)
        if n["type"] == "TextGenerate" and n["widgets_values"][2] == "off":
            expected = TEXTGEN_OFF_WIDGETS
        assert len(n["widgets_values"]) == expected, f"{n['type']} {n['id']}: widget count"
        assert [o["type"] for o in n["outputs"]] == outputs, f"{n['type']} {n['id']}: outputs"
        for i in n["inputs"]:
            if "widget" in i:
                assert i["widget"]["name"] in widgets, f"{n['type']}: {i['name']} is not a widget"
            else:
                assert sockets.get(i["name"]) in (i["type"], "*"), f"{n['type']}: socket {i['name']}"
        if n["type"] in pack_specs():
            check_values(n["type"], dict(zip([w for w in widgets], n["widgets_values"])))


def test_the_previous_versions_enhancer_workflow_still_loads():
    """A workflow saved by the previous committed version (git HEAD) keeps loading: the frontend puts
    widgets_values on the widgets by position, so the enhancer's widgets must keep their order (its
    custom-only sampling widgets stay flat, see nodes/enhancer_node.py); a widget added since comes
    after every saved value and keeps its default."""
    import subprocess

    try:
        old = subprocess.run(["git", "show", "HEAD:workflows/pe_text_to_image.json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout with a committed workflows/pe_text_to_image.json")
    wf = json.loads(old)
    assert check_ui_format(wf) == []
    enhancers = [n for n in wf["nodes"] if n["type"] == "Qwen35FastPromptEnhancer"]
    assert enhancers
    for n in enhancers:
        widgets = spec(n["type"])[0]
        assert len(n["widgets_values"]) <= len(widgets), "the saved values no longer line up with the widgets"
        values = dict(zip(widgets, n["widgets_values"]))
        check_values(n["type"], values)  # every value valid where it lands (attention a choice, ...)


def test_the_enhancers_sampling_widgets_are_marked_custom_only():
    """temperature..presence_penalty apply to preset 'custom' only: hidden as advanced, labelled
    'custom: ...', and their tooltips say so first."""
    inputs = {i.id: i for i in pack_specs()["Qwen35FastPromptEnhancer"][3].inputs}
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty"):
        i = inputs[name]
        assert i.optional and i.advanced
        assert i.display_name == f"custom: {name}"
        assert i.tooltip.startswith("Used only with preset 'custom'")


def check_values(node_type, values):
    schema = pack_specs()[node_type][3]
    for i in schema.inputs:
        if i.id not in values:
            continue
        v = values[i.id]
        if i.io_type == "COMBO" and i.options:
            assert v in i.options or i.id in ("clip_name", "mtp_head"), f"{node_type}.{i.id}={v!r}"
        if getattr(i, "min", None) is not None:
            assert i.min <= v <= i.max, f"{node_type}.{i.id}={v} out of range"
        if i.io_type in ("INT", "FLOAT", "BOOLEAN", "STRING"):
            assert isinstance(v, {"INT": int, "FLOAT": (int, float), "BOOLEAN": bool, "STRING": str}[i.io_type])


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_names_models_with_links(path):
    wf = json.loads(path.read_text())
    models = {m["name"]: m for m in wf["extra"]["models"]}
    loaders = [n for n in wf["nodes"] if n["type"] in ("Qwen35FastCLIPLoader", "CLIPLoader")]
    pe_names = {n["widgets_values"][0] for n in loaders}
    on_a_server = any(n["type"] == "Qwen35FastPromptEnhancerServer" for n in wf["nodes"])  # no enhancer file
    assert on_a_server or pe_names & {"qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors",
                                      "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors"}
    for n in wf["nodes"]:
        for m in n["properties"].get("models", []):
            assert m["name"] in n["widgets_values"] and m["directory"] and m["url"]
            assert m["name"] in models
    for name, m in models.items():
        assert m["url"].startswith("https://huggingface.co/"), name
        if "_pe_" in name:
            assert m["url"].endswith("/text_encoders/" + name) and m["directory"] == "text_encoders"
    for n in wf["nodes"]:
        if n["type"] == "Qwen35FastCLIPLoader":  # the head is fetched on first use, not a file to find
            assert n["widgets_values"][1] == "download (base model of the same size)"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_api_twin_matches_schemas(path):
    prompt = json.loads(path.read_text())
    for nid, node in prompt.items():
        widgets, sockets, _ = spec(node["class_type"])
        for key, value in node["inputs"].items():
            if isinstance(value, list):
                src, slot = value
                assert src in prompt, f"{path.name}: node {nid} links to missing {src}"
                src_out = spec(prompt[src]["class_type"])[2][slot]
                assert key in sockets or key in widgets, f"{path.name}: {node['class_type']}.{key}"
                assert sockets.get(key, src_out) in (src_out, "*"), f"{path.name}: {key} type"
            else:
                base = key.split(".")[-1]
                assert key in widgets or base in widgets, f"{path.name}: {node['class_type']} has no {key}"
        if node["class_type"] in pack_specs():
            check_values(node["class_type"], {k: v for k, v in node["inputs"].items() if not isinstance(v, list)})
            required = [i.id for i in pack_specs()[node["class_type"]][3].inputs if not i.optional]
            assert set(required) <= set(node["inputs"]), f"{path.name}: {node['class_type']} misses inputs"


def test_each_ui_workflow_has_an_api_twin_with_the_same_text_nodes():
    pairs = {p.name: p.stem + "_api.json" for p in UI_FILES}  # names pair: <name>.json <-> api/<name>_api.json
    assert len(pairs) >= 3 and sorted(pairs.values()) == [p.name for p in API_FILES]
    for ui_name, api_name in pairs.items():
        ui = {str(n["id"]): n for n in json.loads((ROOT / "workflows" / ui_name).read_text())["nodes"]}
        api = json.loads((ROOT / "workflows" / "api" / api_name).read_text())
        for nid, node in api.items():
            assert nid in ui, f"{api_name} {nid} is not in the UI workflow"
            assert ui[nid]["type"] == node["class_type"]
            widgets = [w for w in spec(node["class_type"])[0]]
            values = dict(zip(widgets, ui[nid]["widgets_values"]))
            for key, value in node["inputs"].items():
                # the twin runs as shipped: every value the UI workflow's (official max_length, head download)
                if not isinstance(value, list):
                    assert values[key.split(".")[-1]] == value, f"{api_name} {nid}.{key}"
                else:
                    src = ui[nid]["inputs"]
                    assert any(i["name"] == key and i["link"] is not None for i in src), f"{api_name} {nid}.{key}"


def test_schema_check_catches_broken_workflows():
    wf = json.loads(UI_FILES[0].read_text())
    assert check_ui_format(wf) == []
    bad = json.loads(json.dumps(wf))
    bad["version"] = 0.3
    bad["links"][0] = bad["links"][0][:5]
    del bad["nodes"][0]["widgets_values"]
    errs = check_ui_format(bad)
    assert len(errs) == 3, errs


def _png_text_chunks(data: bytes) -> dict[str, str]:
    """tEXt / zTXt / iTXt chunks of a PNG (stdlib only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, out = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")
            _, _, text = rest.partition(b"\0")
            out[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode("utf-8")
    return out


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_workflow_runs_as_shipped(path):
    wf = json.loads(path.read_text())
    assert wf.get("id") is not None or "id" not in wf  # the frontend refuses "id": null
    nodes = wf["nodes"]
    notes = [n for n in nodes if n["type"] == "Note"]
    assert len(notes) == 1 and "download" in notes[0]["widgets_values"][0].lower()
    for n in nodes:
        if n["type"] == "Qwen35FastPromptEnhancer":
            values = dict(zip(spec(n["type"])[0], n["widgets_values"]))
            assert values["system_prompt"] == "official"
            assert values["max_length"] == {"text-to-image": 16256, "edit": 24000}[values["preset"]]
        if n["type"] == "TextGenerate":
            assert n["widgets_values"][1] >= 16256  # speed does not depend on it: the point of the pack
    png = path.with_suffix(".png")
    assert png.is_file(), f"{png.name} missing: run scripts/make_workflows.py"
    embedded = json.loads(_png_text_chunks(png.read_bytes())["workflow"])
    assert embedded == wf, f"{png.name} embeds another version of {path.name}: run scripts/make_workflows.py"
