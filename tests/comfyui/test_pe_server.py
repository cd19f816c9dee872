"""The enhancer's server backend against a real OpenAI-compatible server: ``transformers serve`` (one per
module, on 127.0.0.1) serving a tiny random Qwen3.5 written here with transformers and ComfyUI's Qwen3.5
tokenizer files. Through the node function (in process, ComfyUI imported) and through a real ComfyUI
server (HTTP + its websocket). No mocked client, no home-made server.

Set ``QWEN35_FAST_COMFYUI=<ComfyUI tree>`` (``scripts/test_comfyui.sh`` runs this file on 0.29.0) and run
with ComfyUI's Python; ``transformers serve`` runs in ``QWEN35_FAST_SERVE_PYTHON`` (default the
repository's ``.venv``, where ``requirements-dev.txt`` installs transformers and its serving extras).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.comfyui import test_comfyui_integration as ci
from tests.openai_server import OpenAIServer, Reply, answer_events, chunk

ROOT = Path(__file__).resolve().parents[2]
COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
SERVE_PY = os.environ.get("QWEN35_FAST_SERVE_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
KEY_VAR, KEY = "QWEN35_PE_TEST_KEY", "sk-qwen35-test-7f3a9c1e5b"
HF_FAKE = "hf_qwen35FakeTokenForTests9d2c7e41"  # HF_TOKEN of the ComfyUI process: a workflow must not reach it
NODE = "Qwen35FastPromptEnhancerServer"
SYSTEM = "Rewrite the prompt. Answer with JSON."
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI tree> to run")]

MAKE_MODEL = r"""
import json, shutil, sys, torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
out, tok = sys.argv[1], sys.argv[2]
cfg = Qwen3_5TextConfig(vocab_size=248320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True,
    layer_types=["linear_attention"] * 3 + ["full_attention"], eos_token_id=248046, pad_token_id=248044,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
torch.manual_seed(0)
Qwen3_5ForCausalLM(cfg).save_pretrained(out)
for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
    shutil.copy(f"{tok}/{f}", out)
"""


class TServe:
    """``transformers serve <tiny model>`` on a free port of 127.0.0.1 (start, kill, restart)."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port, self.proc = model, log, ci._free_port(), None
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [SERVE_PY, "-m", "transformers.cli.transformers", "serve", str(self.model), "--device", "cpu",
             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=env)
        end = time.time() + 120
        while time.time() < end:
            try:
                urllib.request.urlopen(self.base_url + "/models", timeout=5).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.3)
        pytest.fail("transformers serve did not start:\n" + self.log.read_text()[-3000:])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def tserve(tmp_path_factory):
    probe = subprocess.run([SERVE_PY, "-c", "import transformers.cli.serve, fastapi, uvicorn, openai, accelerate"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no transformers serve in {SERVE_PY}: pip install -r requirements-dev.txt ({probe.stderr[-300:]})")
    comfy = Path(COMFY).resolve()
    ci._ensure_vocab(comfy, ci._python(comfy))
    base = tmp_path_factory.mktemp("tserve")
    model = base / "tiny-qwen35"
    subprocess.run([SERVE_PY, "-c", MAKE_MODEL, str(model), str(comfy / "comfy/text_encoders/qwen35_tokenizer")],
                   check=True, capture_output=True)
    srv = TServe(model, base / "serve.log")
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def comfy_mod():
    from tests.oracles.comfy_tree import import_comfyui

    return import_comfyui(COMFY)


@pytest.fixture
def user_dir(comfy_mod, tmp_path):
    """ComfyUI's user directory (where the key pairing file lives) set to a fresh folder, as --user-directory does."""
    import folder_paths

    old = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path))
    yield tmp_path
    folder_paths.set_user_directory(old)


def _pair(user: Path, *entries) -> None:
    """What the user writes to pair keys with servers (the workflow cannot)."""
    (user / "qwen35_fast_servers.json").write_text(json.dumps(
        {"servers": [{"base_url": url, "api_key_env": var} for url, var in entries]}))


def _lists(srv, **over) -> dict:
    values = dict(base_url=srv.base_url, model=str(srv.model), api="auto", api_key_env="", max_concurrent=4,
                  timeout_s=60, prompt="a red fox in snow", system_prompt=SYSTEM, preset="text-to-image",
                  max_length=24, seed=1, thinking=True, megapixels=1.0)
    values.update(over)
    return {k: (v if isinstance(v, list) else [v]) for k, v in values.items()}


def _run_node(**lists):
    from qwen35_fast.nodes.server_enhancer_node import Qwen35PromptEnhancerServer

    return Qwen35PromptEnhancerServer.execute(**lists).args


class Hook:
    def __init__(self, comfy):
        self.calls, self.comfy = [], comfy

    def __call__(self, value, total, preview, node_id=None):
        self.calls.append((time.perf_counter(), value, total))

    def __enter__(self):
        self.old = self.comfy.utils.PROGRESS_BAR_HOOK
        self.comfy.utils.set_progress_bar_global_hook(self)
        return self

    def __exit__(self, *exc):
        self.comfy.utils.set_progress_bar_global_hook(self.old)


def _long_run(tserve, hook) -> tuple[threading.Thread, list]:
    """A 4000-token node run in a thread, returned once its stream reached the progress hook 3 times."""
    errors = []

    def run():
        try:
            _run_node(**_lists(tserve, max_length=4000))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)
    t = threading.Thread(target=run)
    t.start()
    end = time.time() + 60
    while len(hook.calls) < 3 and time.time() < end:
        time.sleep(0.01)
    return t, errors


# ---------------------------------------------------------------------------------------------
# the node function, in process


def test_text_to_image_run_streams_to_the_progress_hook(tserve, comfy_mod, caplog):
    caplog.set_level("INFO")
    with Hook(comfy_mod) as hook:
        out = _run_node(**_lists(tserve))
    rewritten, thinking, ratio, follow, width, height, parse_ok, status = out
    assert len(rewritten) == 1 and isinstance(width[0], int) and width[0] % 16 == 0
    # random weights never close the thinking block in 24 tokens: the documented fallback, the user's prompt
    assert parse_ok[0] or rewritten[0] == "a red fox in snow", (rewritten, parse_ok)
    assert thinking[0] or parse_ok[0]
    lines = status[0].split("\n")
    assert lines[0].startswith("Stopped at max_length 24 (finish 'length')"), lines  # what to act on, first
    assert "transformers server" in status[0] and "tok/s" in status[0], status
    assert "Not honoured by transformers: presence_penalty" in status[0] and "api auto: transformers" in status[0]
    assert len(hook.calls) > 1, hook.calls  # streamed: more than one progress update
    print(f"status: {status[0]}; progress updates: {len(hook.calls)}")


def test_overhead_over_the_servers_own_completion(tserve, comfy_mod):
    """Reported, not asserted: the node's wall time against a bare streamed request of the same body."""
    from qwen35_fast.enhancer.server_api import ServerSpec, request_body
    from qwen35_fast.enhancer.server_enhancer import ServerJob, prepare

    spec = ServerSpec(tserve.base_url, str(tserve.model), api="transformers", timeout_s=60)
    p = prepare(ServerJob("a red fox in snow", system_prompt=SYSTEM, max_length=48, seed=5))
    body = request_body(spec, p.messages, p.settings, 48, 5, True)[0]
    raw, node = [], []
    for i in range(3):
        t = time.perf_counter()
        req = urllib.request.Request(tserve.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            while r.readline():
                pass
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        _run_node(**_lists(tserve, max_length=48, seed=5))
        node.append(time.perf_counter() - t)
    r, n = statistics.median(raw), statistics.median(node)
    print(f"OVERHEAD: server's own streamed completion {r * 1000:.0f} ms, through the node {n * 1000:.0f} ms "
          f"(median of 3): {100 * (n - r) / r:+.1f}%")


def test_cancel_mid_stream_then_a_good_run(tserve, comfy_mod):
    mm = comfy_mod.model_management
    with Hook(comfy_mod) as hook:
        t, errors = _long_run(tserve, hook)
        assert len(hook.calls) >= 3, "the stream never started"
        clicked = time.perf_counter()
        mm.interrupt_current_processing(True)
        t.join(30)
        latency = time.perf_counter() - clicked
    mm.interrupt_current_processing(False)
    assert not t.is_alive() and errors and isinstance(errors[0], mm.InterruptProcessingException), errors
    assert hook.calls[-1][1] < 4000
    print(f"CANCEL LATENCY (node function): {latency * 1000:.0f} ms")
    assert _run_node(**_lists(tserve, seed=2))[7][0]


def test_wrong_model_lists_the_served_models(tserve, comfy_mod):
    from qwen35_fast.enhancer.server_backend import ServerError

    with pytest.raises(ServerError) as err:
        _run_node(**_lists(tserve, model="Qwen/Not-Served"))
    msg = str(err.value)
    print(msg)
    assert "does not serve model 'Qwen/Not-Served'" in msg and str(tserve.model) in msg and "It serves" in msg


def test_key_variable_unpaired_then_paired_but_unset(tserve, comfy_mod, monkeypatch, user_dir):
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(ValueError, match=f"does not pair {KEY_VAR} with"):
        _run_node(**_lists(tserve, api_key_env=KEY_VAR))
    _pair(user_dir, (tserve.base_url, KEY_VAR))
    with pytest.raises(ValueError, match=f"environment variable {KEY_VAR} .*not set"):
        _run_node(**_lists(tserve, api_key_env=KEY_VAR))


def test_images_the_server_drops_are_named_in_the_status(tserve, comfy_mod):
    """The tiny model is text-only: transformers serve keeps the text parts of the user turn and drops the
    image without a word; the prompt token count it reports shows it (a 1024 x 1024 image alone is about
    1024 tokens)."""
    import torch

    image = torch.rand(1, 1024, 1024, 3)
    out = _run_node(**_lists(tserve, preset="edit", prompt="<image1> at night", max_length=8), image1=[image])
    status = out[7][0].split("\n")
    assert any(line.startswith("The server dropped the image") for line in status[:2]), status


def test_four_prompts_run_concurrently_in_order(tserve, comfy_mod, monkeypatch):
    """The four requests are in flight at once (each stream's open interval overlaps every other's);
    whether that is faster depends on the server batching them (``transformers serve`` on two CPU
    cores barely does), so the wall times are reported, not asserted."""
    from qwen35_fast.enhancer import server_backend

    prompts = [f"prompt number {k}: a lighthouse at dusk" for k in range(4)]
    singles = 0.0
    for p in prompts:
        t = time.perf_counter()
        _run_node(**_lists(tserve, prompt=p, max_length=40))
        singles += time.perf_counter() - t
    spans, run = [], server_backend.ChatStream.run

    def timed_run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    monkeypatch.setattr(server_backend.ChatStream, "run", timed_run)
    t = time.perf_counter()
    out = _run_node(**_lists(tserve, prompt=prompts, max_length=40))
    wall = time.perf_counter() - t
    print(f"4 prompts: {wall:.2f} s concurrently, {singles:.2f} s one after another")
    assert out[0] == prompts  # still thinking at 40 tokens: the fallback gives each prompt back, in order
    assert len(out[7]) == 4 and len(spans) == 4
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans  # all four open at the same time


def test_server_killed_mid_stream_then_restarted(tserve, comfy_mod):
    from qwen35_fast.enhancer.server_backend import ServerError

    with Hook(comfy_mod) as hook:
        t, errors = _long_run(tserve, hook)
        tserve.kill()
        t.join(30)
    assert errors and isinstance(errors[0], ServerError), errors
    print(f"server killed: {errors[0]}")
    assert "broke mid-answer" in str(errors[0]) or "ended before" in str(errors[0])
    with pytest.raises(ServerError, match="Cannot reach"):
        _run_node(**_lists(tserve))
    tserve.start()
    assert _run_node(**_lists(tserve))[7][0]


# ---------------------------------------------------------------------------------------------
# through a real ComfyUI server


@pytest.fixture(scope="module")
def comfy_server(tmp_path_factory, tserve):
    comfy = Path(COMFY).resolve()
    base = tmp_path_factory.mktemp("comfy_pe_server")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / ci.PACK_DIR_NAME).symlink_to(ROOT)
    (base / "user").mkdir()
    _pair(base / "user", (tserve.base_url, KEY_VAR))  # the user pairs the key with the server, outside workflows
    hub = ci._prompt_hub()
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(base / "hf"), HF_TOKEN=HF_FAKE, **{KEY_VAR: KEY})
    env.pop("HF_HUB_OFFLINE", None)
    try:
        with ci.running_comfyui(comfy, base, env) as srv:
            srv.base_dir = base
            srv.ws = Socket(srv.port)
            yield srv
    finally:
        hub.stop()


class Socket:
    """ComfyUI's websocket (aiohttp, which ComfyUI ships), read in a thread: (time, message) pairs."""

    def __init__(self, port: int):
        import asyncio

        import aiohttp

        self.client_id, self.messages = "qwen35-pe-server-test", []

        async def listen():
            async with aiohttp.ClientSession() as s, s.ws_connect(
                    f"http://127.0.0.1:{port}/ws?clientId={self.client_id}") as ws:
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.TEXT:
                        self.messages.append((time.perf_counter(), json.loads(m.data)))
        threading.Thread(target=lambda: asyncio.run(listen()), daemon=True).start()
        time.sleep(1.0)

    def of(self, kind: str, prompt_id: str) -> list:
        return [(t, m["data"]) for t, m in self.messages if m.get("type") == kind
                and m.get("data", {}).get("prompt_id") == prompt_id]


def _graph(srv, tserve, prompts=None, **over) -> dict:
    over = {"system_prompt": "official", "api_key_env": KEY_VAR, **over}
    inputs = {k: v[0] for k, v in _lists(tserve, **over).items()}
    g = {"1": {"class_type": "Qwen35FastPromptEnhancerServer", "inputs": inputs}}
    if prompts:
        for k, p in enumerate(prompts):
            g[f"s{k}"] = {"class_type": "PrimitiveStringMultiline", "inputs": {"value": p}}
        g["list"] = {"class_type": "CreateList", "inputs": {f"inputs.input{k}": [f"s{k}", 0]
                                                            for k in range(len(prompts))}}
        inputs["prompt"] = ["list", 0]
    for out in (0, 7):
        g[f"p{out}"] = {"class_type": "PreviewAny", "inputs": {"source": ["1", out]}}
    return g


def _queue(srv, graph) -> str:
    status, body = srv.post("/prompt", {"prompt": graph, "client_id": srv.ws.client_id})
    assert status == 200, body
    return body["prompt_id"]


def test_comfyui_text_to_image_run_and_key_never_shown(comfy_server, tserve):
    srv = comfy_server
    pid = _queue(srv, _graph(srv, tserve))
    h = srv.wait(pid, timeout=120)
    assert h["status"]["status_str"] == "success", ci._error(h)
    texts = ci._texts(h)
    assert texts["p0"] == ["a red fox in snow"] or texts["p0"][0]
    assert "tok/s" in texts["p7"][0]
    assert len(srv.ws.of("progress", pid)) > 1  # streaming reached ComfyUI's progress bar more than once
    saved = json.dumps(srv.get(f"/history/{pid}")) + srv.log_path.read_text() + json.dumps(srv.ws.messages)
    assert KEY_VAR in saved and KEY not in saved  # the variable's name is in the workflow, never the key


def _cancel_when_running(srv, pid) -> tuple[list[float], float]:
    """Cancel prompt ``pid`` (``POST /interrupt``) once it reported progress three times; the times
    ComfyUI said it was interrupted, and when Cancel was pressed (``time.perf_counter``)."""
    end = time.time() + 60
    while len(srv.ws.of("progress", pid)) < 3 and time.time() < end:
        time.sleep(0.01)
    clicked = time.perf_counter()
    srv.post("/interrupt", {})
    h = srv.wait(pid, timeout=60)
    done = [t for t, _ in srv.ws.of("execution_interrupted", pid)]
    assert h["status"]["status_str"] == "error" and done, h["status"]
    return done, clicked


def test_comfyui_cancel_mid_stream_then_good_run(comfy_server, tserve):
    srv = comfy_server
    pid = _queue(srv, _graph(srv, tserve, max_length=4000, seed=7))
    done, clicked = _cancel_when_running(srv, pid)
    print(f"CANCEL LATENCY (ComfyUI server): {(done[0] - clicked) * 1000:.0f} ms from POST /interrupt")
    h = srv.wait(_queue(srv, _graph(srv, tserve, seed=8)), timeout=120)
    assert h["status"]["status_str"] == "success", ci._error(h)


def test_comfyui_errors_name_the_fix(comfy_server, tserve):
    srv = comfy_server
    h = srv.wait(_queue(srv, _graph(srv, tserve, model="Qwen/Not-Served")), timeout=60)
    assert str(tserve.model) in ci._error(h)["exception_message"]
    h = srv.wait(_queue(srv, _graph(srv, tserve, api_key_env="QWEN35_PE_TEST_UNSET")), timeout=60)
    assert "QWEN35_PE_TEST_UNSET" in ci._error(h)["exception_message"]


def test_comfyui_list_of_four_prompts_in_order(comfy_server, tserve):
    srv = comfy_server
    prompts = [f"list prompt {k}: a lighthouse" for k in range(4)]
    h = srv.wait(_queue(srv, _graph(srv, tserve, prompts=prompts, max_length=40)), timeout=180)
    assert h["status"]["status_str"] == "success", ci._error(h)
    assert ci._texts(h)["p0"] == prompts



def pieces(secret: str, text: str, n: int = 8) -> list[str]:
    """Oracle: the n-character pieces of ``secret`` found in ``text`` (brute force)."""
    return sorted({secret[i:i + n] for i in range(len(secret) - n + 1) if secret[i:i + n] in text})


def _node_graph(srv, **inputs) -> dict:
    """The server node with the node's own defaults (from ComfyUI's /object_info) but for ``inputs``, and
    previews of rewritten_prompt (p0) and status (p7)."""
    info = srv.object_info[NODE]["input"]
    values = {k: spec[1]["default"] for part in ("required", "optional") for k, spec in info.get(part, {}).items()
              if isinstance(spec[1], dict) and "default" in spec[1]}
    values.update(inputs)
    return {"1": {"class_type": NODE, "inputs": values},
            "p0": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
            "p7": {"class_type": "PreviewAny", "inputs": {"source": ["1", 7]}}}


def test_comfyui_node_defaults_answer(comfy_server, tserve):
    """Every input at the node's default (api auto, official system prompt, sampling, seed 42), but where the
    server is, its model, a prompt, and max_length (the official 16256 would take the tiny random model on
    two CPU cores many minutes)."""
    srv = comfy_server
    g = _node_graph(srv, base_url=tserve.base_url, model=str(tserve.model), prompt="a lighthouse at dawn",
                    max_length=24)
    assert g["1"]["inputs"]["api"] == "auto" and g["1"]["inputs"]["seed"] == 42
    h = srv.wait(_queue(srv, g), timeout=120)
    assert h["status"]["status_str"] == "success", ci._error(h)
    status = ci._texts(h)["p7"][0]
    assert "api auto: transformers" in status and "transformers server" in status, status


def test_comfyui_shipped_server_workflow_runs(comfy_server, tserve):
    """The shipped API twin, its server node pointed at this test's server (and a short max_length)."""
    srv = comfy_server
    prompt = json.loads((ROOT / "workflows" / "api" / "pe_text_to_image_server_api.json").read_text())
    node = next(n for n in prompt.values() if n["class_type"] == NODE)
    node["inputs"].update(base_url=tserve.base_url, model=str(tserve.model), max_length=24)
    h = srv.wait(_queue(srv, prompt), timeout=120)
    assert h["status"]["status_str"] == "success", ci._error(h)
    assert ci._texts(h)


def test_comfyui_hf_token_goes_only_where_the_user_paired_it(comfy_server):
    """A workflow names HF_TOKEN (set in the ComfyUI process) for a loopback host: refused before any
    connection, the message naming the entry to add. Paired by the user, it is sent; the server echoes the
    Authorization header as its model name, in its answer and in an error body: no 8 characters of the token
    anywhere (log, status, /history, the websocket)."""
    srv = comfy_server

    def reply(req):
        auth = req["headers"].get("Authorization", "")
        if "error please" in json.dumps(req["body"]):
            return Reply(status=400, error_body=json.dumps({"error": {"message": "y" * 380 + auth}}).encode())
        return Reply(answer_events(f'{{"rewritten_prompt": "echo {auth}", "wh_ratio": "1:1"}}', reasoning=auth,
                                   model=auth))

    echo = OpenAIServer(reply)
    pairing = srv.base_dir / "user" / "qwen35_fast_servers.json"
    kept = pairing.read_text()
    try:
        g = _node_graph(srv, base_url=echo.base_url, model="test-model", api_key_env="HF_TOKEN", prompt="a fox",
                        system_prompt=SYSTEM, max_length=64, seed=11)
        h = srv.wait(_queue(srv, g), timeout=60)
        msg = ci._error(h)["exception_message"]
        entry = json.dumps({"base_url": f"http://127.0.0.1:{echo.port}/v1", "api_key_env": "HF_TOKEN"})
        assert "does not pair HF_TOKEN" in msg and entry in msg, msg
        assert echo.connections == 0
        _pair(srv.base_dir / "user", (echo.base_url, "HF_TOKEN"))
        h = srv.wait(_queue(srv, {**g, "1": {**g["1"], "inputs": {**g["1"]["inputs"], "seed": 12}}}), timeout=60)
        assert h["status"]["status_str"] == "success", ci._error(h)
        assert echo.requests[-1]["headers"]["Authorization"] == f"Bearer {HF_FAKE}"
        bad = {**g["1"]["inputs"], "seed": 13, "prompt": "error please"}
        h2 = srv.wait(_queue(srv, {**g, "1": {**g["1"], "inputs": bad}}), timeout=60)
        assert h2["status"]["status_str"] == "error"
        seen = (json.dumps(srv.get("/history")) + srv.log_path.read_text() + json.dumps(srv.ws.messages))
        assert "echo" in seen and "y" * 100 in seen  # the echoed answer and error did arrive, redacted
        assert not pieces(HF_FAKE, seen), pieces(HF_FAKE, seen)
    finally:
        pairing.write_text(kept)
        echo.stop()


def test_comfyui_cancel_a_5000_events_a_second_stream_then_max_length_64(comfy_server):
    srv = comfy_server
    fast = OpenAIServer(lambda req: Reply(rate=5000, endless_event=chunk("x"), framing="close"))
    try:
        g = _node_graph(srv, base_url=fast.base_url, model="test-model", prompt="a fox", system_prompt=SYSTEM,
                        max_length=65536, thinking=False, seed=21)
        done, clicked = _cancel_when_running(srv, _queue(srv, g))
        print(f"CANCEL LATENCY at 5,000 events/s: {(done[0] - clicked) * 1000:.0f} ms; server saw the close after "
              f"{((fast.closed_at or clicked) - clicked) * 1000:.0f} ms")
        assert done[0] - clicked < 1.0
        assert fast.closed.wait(1.0) and fast.closed_at - clicked < 1.0
        g["1"]["inputs"].update(max_length=64, seed=22)
        h = srv.wait(_queue(srv, g), timeout=60)
        assert h["status"]["status_str"] == "success", ci._error(h)
        status = ci._texts(h)["p7"][0]
        assert status.startswith("Cut at max_length 64") and ": 64 tokens in" in status, status
    finally:
        fast.stop()
