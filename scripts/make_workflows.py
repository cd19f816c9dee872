"""Write the example workflows (UI format, schema 0.4) and their API-format twins from one spec.

    python scripts/make_workflows.py        # rewrites workflows/*.json (+ .png) and workflows/api/*.json

Each graph is declared once as nodes with their widget values and links; the UI file gets
positions, slots and ``properties.models`` (file names + download links), the API twin the same
nodes in ``{id: {class_type, inputs}}`` form. API twins only keep the text part of a graph
(loader -> enhancer/generate -> text preview): the image half needs Qwen-Image 2.1 models. Each UI
file ``<name>.json`` has its twin ``api/<name>_api.json`` and a picture ``<name>.png`` with the graph
embedded (when Pillow is installed: the picture kept, a real screenshot from ``scripts/screenshots.py``,
which also writes the ``<name>.jpg`` template thumbnail; drawn where none exists). UI files carry a
stable UUID ``id`` (the frontend's schema refuses ``null``) and a Note saying what to download.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "workflows"

HF = "https://huggingface.co/Comfy-Org/Qwen-Image-2.1/resolve/main"
PE_T2I = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"
PE_I2I = "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors"
MTP = "download (base model of the same size)"  # the loader's default: only the mtp.* tensors, once
DIT = "qwen_image_2.1_int8_convrot.safetensors"
TE = "qwen3vl_8b_int8_convrot.safetensors"
VAE = "qwen_image_2.1_vae_bf16.safetensors"
MODELS = {
    PE_T2I: (f"{HF}/text_encoders/{PE_T2I}", "text_encoders"),
    PE_I2I: (f"{HF}/text_encoders/{PE_I2I}", "text_encoders"),
    DIT: (f"{HF}/diffusion_models/{DIT}", "diffusion_models"),
    TE: (f"{HF}/text_encoders/{TE}", "text_encoders"),
    VAE: (f"{HF}/vae/{VAE}", "vae"),
}

SYSTEM_HINT = "official"  # Qwen's prompt for the preset, fetched once (Qwen Research License, not bundled)
NOTE_T2I = ("First run downloads what is missing, with progress: the enhancer file "
            f"{PE_T2I} (about 10 GB, Comfy-Org/Qwen-Image-2.1) and the MTP head (about 0.5 GB, only the "
            "mtp.* tensors of Qwen/Qwen3.5-9B) into models/text_encoders, and Qwen's official system prompt into "
            "models/qwen_image_pe. For the image half put these in place (hf download Comfy-Org/Qwen-Image-2.1 "
            f"<file> --local-dir ComfyUI/models): diffusion_models/{{DIT}}, text_encoders/{{TE}}, vae/{{VAE}}. "
            "max_length 16256 is the official value: decoding speed does not depend on it.")
NOTE_EDIT = ("Edit mode: connect up to 10 images (image1..image10) and refer to them as <image1>.. in the prompt. "
             "First run downloads what is missing, with progress: "
             f"{PE_I2I} (about 10 GB) and the MTP head (about 0.5 GB) into models/text_encoders, and Qwen's "
             "official edit system prompt. Image half: diffusion_models/{DIT}, text_encoders/{TE}, vae/{VAE} "
             "(hf download Comfy-Org/Qwen-Image-2.1 <file> --local-dir ComfyUI/models). max_length 24000 is "
             "the official value: decoding speed does not depend on it.")
NOTE_TEXTGEN = ("Core Load CLIP + TextGenerate with the length-aware patch in between: the cost per token follows the "
                f"text written so far, not max_length. Needs {PE_T2I} in models/text_encoders (hf download "
                f"Comfy-Org/Qwen-Image-2.1 text_encoders/{PE_T2I} --local-dir ComfyUI/models).")
T2I_PROMPT = "A red fox sleeping under a paper lantern in a snowy Kyoto alley at dusk"
EDIT_PROMPT = "Make it a rainy night and add neon reflections on the ground"

# Widget names per node type, in UI order ("+control" marks a control_after_generate value).
WIDGETS = {
    "Qwen35FastCLIPLoader": ["clip_name", "mtp_head", "device"],
    "Qwen35FastPromptEnhancer": ["prompt", "system_prompt", "preset", "max_length", "seed", "+control", "mtp",
                                 "thinking", "megapixels", "temperature", "top_k", "top_p", "min_p",
                                 "presence_penalty", "attention", "thinking_budget"],
    "Qwen35FastPromptEnhancerServer": ["base_url", "model", "api", "api_key_env", "max_concurrent", "timeout_s",
                                       "prompt", "system_prompt", "preset", "max_length", "seed", "+control",
                                       "thinking", "megapixels", "temperature", "top_k", "top_p", "min_p",
                                       "presence_penalty", "deadline_s"],
    "Qwen35FastLengthAwarePatch": ["mtp", "attention"],
    "CLIPLoader": ["clip_name", "type", "device"],
    "TextGenerate": ["prompt", "max_length", "sampling_mode", "sampling_mode.temperature", "sampling_mode.top_k",
                     "sampling_mode.top_p", "sampling_mode.min_p", "sampling_mode.repetition_penalty",
                     "sampling_mode.seed", "sampling_mode.presence_penalty", "thinking", "use_default_template"],
    "PreviewAny": [],
    "LoadImage": ["image", "+upload"],
    "Note": ["text"],
    "ImageScale": ["upscale_method", "width", "height", "crop"],
    "UNETLoader": ["unet_name", "weight_dtype"],
    "VAELoader": ["vae_name"],
    "ModelSamplingAuraFlow": ["shift"],
    "CLIPTextEncode": ["text"],
    "TextEncodeQwenImageEdit": ["prompt"],
    "EmptySD3LatentImage": ["width", "height", "batch_size"],
    "KSampler": ["seed", "+control", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
    "VAEDecode": [],
    "SaveImage": ["filename_prefix"],
}
# Socket inputs (name, type) and outputs per node type, in slot order.
SOCKETS = {
    "Qwen35FastCLIPLoader": ([], [("CLIP", "CLIP"), ("status", "STRING")]),
    "Qwen35FastPromptEnhancer": ([("clip", "CLIP"), *[(f"image{k}", "IMAGE") for k in range(1, 11)]],
                                 [("rewritten_prompt", "STRING"), ("thinking", "STRING"), ("wh_ratio", "STRING"),
                                  ("ratio_follow", "STRING"), ("width", "INT"), ("height", "INT"),
                                  ("parse_ok", "BOOLEAN")]),
    "Qwen35FastPromptEnhancerServer": ([(f"image{k}", "IMAGE") for k in range(1, 11)],
                                       [("rewritten_prompt", "STRING"), ("thinking", "STRING"), ("wh_ratio", "STRING"),
                                        ("ratio_follow", "STRING"), ("width", "INT"), ("height", "INT"),
                                        ("parse_ok", "BOOLEAN"), ("status", "STRING")]),
    "Qwen35FastLengthAwarePatch": ([("clip", "CLIP")], [("CLIP", "CLIP")]),
    "CLIPLoader": ([], [("CLIP", "CLIP")]),
    "TextGenerate": ([("clip", "CLIP"), ("image", "IMAGE"), ("video", "IMAGE"), ("audio", "AUDIO")],
                     [("generated_text", "STRING")]),
    "PreviewAny": ([("source", "*")], [("STRING", "STRING")]),
    "LoadImage": ([], [("IMAGE", "IMAGE"), ("MASK", "MASK")]),
    "Note": ([], []),
    "ImageScale": ([("image", "IMAGE")], [("IMAGE", "IMAGE")]),
    "UNETLoader": ([], [("MODEL", "MODEL")]),
    "VAELoader": ([], [("VAE", "VAE")]),
    "ModelSamplingAuraFlow": ([("model", "MODEL")], [("MODEL", "MODEL")]),
    "CLIPTextEncode": ([("clip", "CLIP")], [("CONDITIONING", "CONDITIONING")]),
    "TextEncodeQwenImageEdit": ([("clip", "CLIP"), ("vae", "VAE"), ("image", "IMAGE")],
                                [("CONDITIONING", "CONDITIONING")]),
    "EmptySD3LatentImage": ([], [("LATENT", "LATENT")]),
    "KSampler": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                  ("latent_image", "LATENT")], [("LATENT", "LATENT")]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [("IMAGE", "IMAGE")]),
    "SaveImage": ([("images", "IMAGE")], []),
}
WIDGET_TYPES = {"prompt": "STRING", "text": "STRING", "width": "INT", "height": "INT", "max_length": "INT",
                "seed": "INT"}


class Graph:
    def __init__(self):
        self.nodes = {}  # id -> dict(type, widgets{name: value}, links{input: (src, slot)}, title, pos)

    def add(self, nid, type_, pos, title=None, **widgets):
        self.nodes[nid] = dict(type=type_, widgets=widgets, links={}, pos=pos, title=title)
        return nid

    def link(self, src, slot, dst, inp):
        self.nodes[dst]["links"][inp] = (src, slot)


def _widget_values(node):
    values = []
    w = node["widgets"]
    for name in WIDGETS[node["type"]]:
        if name == "+control":
            values.append("fixed")
        elif name == "+upload":
            values.append("image")
        elif node["type"] == "TextGenerate" and name.startswith("sampling_mode.") and w["sampling_mode"] == "off":
            continue
        else:
            values.append(w[name])
    return values


def to_ui(graph: Graph, models: list[str], name: str) -> dict:
    links, nodes = [], []
    ids = sorted(graph.nodes)
    out_links = {nid: {} for nid in ids}
    for nid in ids:
        for inp, (src, slot) in graph.nodes[nid]["links"].items():
            lid = len(links) + 1
            socket_types = dict(SOCKETS[graph.nodes[src]["type"]][1])
            out_type = list(socket_types.values())[slot]
            links.append([lid, src, slot, nid, None, out_type, inp])
            out_links[src].setdefault(slot, []).append(lid)
    link_by_target = {(t, inp): lid for lid, _, _, t, _, _, inp in links}
    for order, nid in enumerate(ids):
        n = graph.nodes[nid]
        socket_in, socket_out = SOCKETS[n["type"]]
        inputs = []
        for name, typ in socket_in:
            inputs.append({"name": name, "type": typ, "link": link_by_target.get((nid, name))})
        for name in n["links"]:
            if name not in dict(socket_in):  # a widget converted to an input (e.g. prompt from the enhancer)
                typ = WIDGET_TYPES.get(name, "STRING")
                inputs.append({"name": name, "type": typ, "widget": {"name": name},
                               "link": link_by_target[(nid, name)]})
        outputs = [{"name": name, "type": typ, "slot_index": i, "links": out_links[nid].get(i, [])}
                   for i, (name, typ) in enumerate(socket_out)]
        size = [380, 260] if n["type"] == "Note" else [360, 160]
        node = {"id": nid, "type": n["type"], "pos": list(n["pos"]), "size": size, "flags": {},
                "order": order, "mode": 0, "inputs": inputs, "outputs": outputs,
                "properties": {"Node name for S&R": n["type"]}, "widgets_values": _widget_values(n)}
        if n["title"]:
            node["title"] = n["title"]
        if n["type"] == "Note":
            node["properties"] = {}
            node["color"], node["bgcolor"] = "#432", "#653"
        elif n["type"].startswith("Qwen35Fast"):
            node["properties"]["cnr_id"] = "comfyui-qwen35-fast"
        else:
            node["properties"]["cnr_id"] = "comfy-core"
        used = [m for m in models if m in _widget_values(n)] if n["type"] != "Note" else []
        if used:
            node["properties"]["models"] = [{"name": m, "url": MODELS[m][0], "directory": MODELS[m][1]}
                                            for m in used]
        nodes.append(node)
    for link in links:  # fix target slots now that input lists exist
        target = next(x for x in nodes if x["id"] == link[3])
        link[4] = [i["name"] for i in target["inputs"]].index(link[6])
    workflow_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfyui-qwen35-fast/workflows/{name}"))
    return {"id": workflow_id, "revision": 0, "last_node_id": max(ids), "last_link_id": len(links), "nodes": nodes,
            "links": [lk[:6] for lk in links], "groups": [], "config": {},
            "extra": {"ds": {"scale": 0.8, "offset": [100, 150]}}, "version": 0.4}


def to_api(graph: Graph, keep: set[int] | None = None) -> dict:
    out = {}
    for nid in sorted(graph.nodes):
        if (keep is not None and nid not in keep) or graph.nodes[nid]["type"] == "Note":
            continue
        n = graph.nodes[nid]
        inputs = {}
        for name in WIDGETS[n["type"]]:
            if name.startswith("+") or name in n["links"]:
                continue
            if n["type"] == "TextGenerate" and name.startswith("sampling_mode.") and \
                    n["widgets"]["sampling_mode"] == "off":
                continue
            inputs[name] = n["widgets"][name]
        for name, (src, slot) in n["links"].items():
            if keep is None or src in keep:
                inputs[name] = [str(src), slot]
        out[str(nid)] = {"class_type": n["type"], "inputs": inputs}
    return out


PE_COMMON = dict(system_prompt=SYSTEM_HINT, seed=42, mtp="auto", thinking=True, megapixels=1.0,
                 temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5, attention="auto",
                 thinking_budget=0)


def _image_half(g: Graph, pe: int, x: int, edit_image: int | None = None):
    """The Qwen-Image 2.1 half in two columns at ``x`` and ``x + 400``: a template (which the frontend opens
    fitted to the whole graph) then opens at a zoom where node text is drawn."""
    g.add(20, "UNETLoader", (x, 0), unet_name=DIT, weight_dtype="default")
    g.add(21, "ModelSamplingAuraFlow", (x + 400, 0), shift=3.1)
    g.link(20, 0, 21, "model")
    g.add(22, "CLIPLoader", (x, 200), clip_name=TE, type="qwen_image", device="default")
    g.add(23, "VAELoader", (x, 400), vae_name=VAE)
    if edit_image is None:
        g.add(24, "CLIPTextEncode", (x + 400, 200), title="Positive (enhanced prompt)", text="")
        g.link(22, 0, 24, "clip")
    else:
        g.add(24, "TextEncodeQwenImageEdit", (x + 400, 200), title="Positive (enhanced prompt)", prompt="")
        g.link(22, 0, 24, "clip")
        g.link(23, 0, 24, "vae")
        g.link(edit_image, 0, 24, "image")
    g.link(pe, 0, 24, "text" if edit_image is None else "prompt")
    g.add(25, "CLIPTextEncode", (x + 400, 400), title="Negative", text="")
    g.link(22, 0, 25, "clip")
    g.add(26, "EmptySD3LatentImage", (x, 600), width=1328, height=1328, batch_size=1)
    g.link(pe, 4, 26, "width")
    g.link(pe, 5, 26, "height")
    g.add(27, "KSampler", (x + 400, 600), seed=42, steps=40, cfg=4.0, sampler_name="euler", scheduler="simple",
          denoise=1.0)
    g.link(21, 0, 27, "model")
    g.link(24, 0, 27, "positive")
    g.link(25, 0, 27, "negative")
    g.link(26, 0, 27, "latent_image")
    g.add(28, "VAEDecode", (x, 800))
    g.link(27, 0, 28, "samples")
    g.link(23, 0, 28, "vae")
    g.add(29, "SaveImage", (x + 400, 900), filename_prefix="qwen_image_2.1_pe")
    g.link(28, 0, 29, "images")


def text_to_image() -> Graph:
    g = Graph()
    g.add(1, "Qwen35FastCLIPLoader", (0, 0), clip_name=PE_T2I, mtp_head=MTP, device="default")
    g.add(2, "Qwen35FastPromptEnhancer", (400, 0), prompt=T2I_PROMPT, preset="text-to-image", max_length=16256,
          **PE_COMMON)
    g.link(1, 0, 2, "clip")
    g.add(3, "PreviewAny", (800, 0), title="Rewritten prompt")
    g.link(2, 0, 3, "source")
    g.add(4, "PreviewAny", (800, 200), title="Thinking")
    g.link(2, 1, 4, "source")
    g.add(5, "PreviewAny", (800, 400), title="Loader status")
    g.link(1, 1, 5, "source")
    g.add(30, "Note", (0, 250), title="What to download", text=NOTE_T2I.format(DIT=DIT, TE=TE, VAE=VAE))
    _image_half(g, 2, 1200)
    return g


NOTE_SERVER = ("The enhancer runs on your OpenAI-compatible server (docs/server.md): start it with the enhancer "
               "(e.g. vllm serve Qwen/Qwen-Image-2.1-PE-T2I --reasoning-parser qwen3), set base_url and model; api "
               "auto asks the server what it honours. A key: put it in an environment variable, name it in "
               "api_key_env, and pair the two in qwen35_fast_servers.json in ComfyUI's user folder. Qwen's official "
               "system prompt is downloaded once into models/qwen_image_pe. For the image half put these in place "
               "(hf download Comfy-Org/Qwen-Image-2.1 <file> --local-dir ComfyUI/models): diffusion_models/{DIT}, "
               "text_encoders/{TE}, vae/{VAE}.")
SERVER_COMMON = dict(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen-Image-2.1-PE-T2I", api="auto",
                     api_key_env="", max_concurrent=4, timeout_s=300, deadline_s=3600)


def text_to_image_server() -> Graph:
    """pe_text_to_image with the server enhancer in the local one's place (same output slots 0-6)."""
    g = Graph()
    common = {k: v for k, v in PE_COMMON.items() if k not in ("mtp", "attention", "thinking_budget")}
    g.add(2, "Qwen35FastPromptEnhancerServer", (400, 0), prompt=T2I_PROMPT, preset="text-to-image",
          max_length=16256, **SERVER_COMMON, **common)
    g.add(3, "PreviewAny", (800, 0), title="Rewritten prompt")
    g.link(2, 0, 3, "source")
    g.add(4, "PreviewAny", (800, 200), title="Thinking")
    g.link(2, 1, 4, "source")
    g.add(5, "PreviewAny", (800, 400), title="Server status")
    g.link(2, 7, 5, "source")
    g.add(30, "Note", (0, 250), title="What to download", text=NOTE_SERVER.format(DIT=DIT, TE=TE, VAE=VAE))
    _image_half(g, 2, 1200)
    return g


def edit() -> Graph:
    g = Graph()
    g.add(6, "LoadImage", (0, 300), image="example.png")
    g.add(1, "Qwen35FastCLIPLoader", (0, 0), clip_name=PE_I2I, mtp_head=MTP, device="default")
    g.add(2, "Qwen35FastPromptEnhancer", (400, 0), prompt=EDIT_PROMPT, preset="edit", max_length=24000,
          **{**PE_COMMON, "presence_penalty": 0.0})
    g.link(1, 0, 2, "clip")
    g.link(6, 0, 2, "image1")
    g.add(3, "PreviewAny", (800, 0), title="Rewritten prompt")
    g.link(2, 0, 3, "source")
    g.add(4, "PreviewAny", (800, 200), title="Thinking")
    g.link(2, 1, 4, "source")
    g.add(5, "PreviewAny", (800, 400), title="ratio_follow")
    g.link(2, 3, 5, "source")
    g.add(30, "Note", (0, 650), title="What to download", text=NOTE_EDIT.format(DIT=DIT, TE=TE, VAE=VAE))
    _image_half(g, 2, 1200, edit_image=6)
    return g


def text_generate() -> Graph:
    g = Graph()
    g.add(1, "CLIPLoader", (0, 0), clip_name=PE_T2I, type="qwen_image", device="default")
    g.add(2, "Qwen35FastLengthAwarePatch", (400, 0), mtp="auto", attention="auto")
    g.link(1, 0, 2, "clip")
    g.add(3, "TextGenerate", (800, 0), prompt="Describe a lighthouse in one sentence.", max_length=24000,
          sampling_mode="on", **{"sampling_mode.temperature": 0.7, "sampling_mode.top_k": 64,
                                 "sampling_mode.top_p": 0.95, "sampling_mode.min_p": 0.05,
                                 "sampling_mode.repetition_penalty": 1.05, "sampling_mode.seed": 7,
                                 "sampling_mode.presence_penalty": 0.0},
          thinking=False, use_default_template=True)
    g.link(2, 0, 3, "clip")
    g.add(4, "PreviewAny", (1200, 0), title="Generated text")
    g.link(3, 0, 4, "source")
    g.add(30, "Note", (0, 250), title="What to download", text=NOTE_TEXTGEN)
    return g


def main() -> None:
    (OUT / "api").mkdir(parents=True, exist_ok=True)
    specs = [
        ("pe_text_to_image_server", "pe_text_to_image_server_api", text_to_image_server(), [DIT, TE, VAE],
         {2, 3, 4, 5}),
        ("pe_text_to_image", "pe_text_to_image_api", text_to_image(), [PE_T2I, DIT, TE, VAE],
         {1, 2, 3, 4, 5}),
        ("pe_edit", "pe_edit_api", edit(), [PE_I2I, DIT, TE, VAE], {1, 2, 3, 4, 5, 6}),
        ("textgenerate_length_aware", "textgenerate_length_aware_api", text_generate(), [PE_T2I], None),
    ]
    for ui_name, api_name, graph, models, keep in specs:
        ui = to_ui(graph, models, ui_name)
        ui["extra"]["models"] = [{"name": m, "url": MODELS[m][0], "directory": MODELS[m][1]} for m in models]
        (OUT / f"{ui_name}.json").write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n")
        api = to_api(graph, keep)  # the UI graph's own values: the twin runs as shipped
        (OUT / "api" / f"{api_name}.json").write_text(json.dumps(api, indent=1, ensure_ascii=False) + "\n")
        try:
            import PIL  # noqa: F401 - the PNG writer draws with Pillow
        except ImportError:
            print("Pillow is not installed: workflow PNGs not rewritten", file=sys.stderr)
        else:
            from workflow_png import write_png

            write_png(OUT / f"{ui_name}.json")


if __name__ == "__main__":
    main()
