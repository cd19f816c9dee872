"""The server enhancer's keys: sent only where the user paired them (``qwen35_fast_servers.json``), never
where a workflow points; every piece of a key redacted from outputs, status, errors and the log. Against
real loopback HTTP servers (``tests/openai_server.py``) that record what reached them; no ComfyUI needed
(``tests/comfyui/test_pe_server.py`` repeats the key cases through a real ComfyUI server)."""

from __future__ import annotations

import json
import logging

import pytest
from qwen35_fast.enhancer import server_probe
from qwen35_fast.enhancer.server_api import ServerError, ServerSpec
from qwen35_fast.enhancer.server_enhancer import ServerJob, run_jobs
from qwen35_fast.enhancer.server_keys import MIN_PIECE, Secret, parse_url

from tests.openai_server import OpenAIServer, Reply, answer_events

KEY = "sk-qwen35-loopback-5b7e1c9d3a2f"
VAR = "QWEN35_KEYTEST_KEY"


@pytest.fixture(autouse=True)
def _fresh_probe():
    server_probe.forget()
    yield
    server_probe.forget()


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(VAR, KEY)
    monkeypatch.setenv("HF_TOKEN", "hf_" + KEY[3:])
    return KEY


def _pair(path, *entries) -> str:
    path.write_text(json.dumps({"servers": [{"base_url": u, "api_key_env": v} for u, v in entries]}))
    return str(path)


def _job(**kw) -> ServerJob:
    return ServerJob(kw.pop("prompt", "a fox in snow"), system_prompt="Rewrite the prompt.", **kw)


def pieces_of(secret: str, text: str) -> list[str]:
    """Oracle: every substring of ``secret`` of MIN_PIECE characters found in ``text`` (brute force)."""
    return sorted({secret[i:i + MIN_PIECE] for i in range(len(secret) - MIN_PIECE + 1)
                   if secret[i:i + MIN_PIECE] in text})


def test_a_workflow_naming_hf_token_for_its_own_host_sends_nothing(key, tmp_path):
    srv = OpenAIServer()
    try:
        spec = ServerSpec(srv.base_url, "test-model", api_key_env="HF_TOKEN")
        with pytest.raises(ValueError) as err:
            run_jobs(spec, [_job()], pairing_file=str(tmp_path / "qwen35_fast_servers.json"))
        msg = str(err.value)
        assert srv.connections == 0 and srv.requests == []  # refused before any connection
        entry = json.dumps({"base_url": f"http://127.0.0.1:{srv.port}/v1", "api_key_env": "HF_TOKEN"})
        assert "qwen35_fast_servers.json" in msg and entry in msg, msg
        assert not pieces_of("hf_" + KEY[3:], msg)
    finally:
        srv.stop()


def test_a_paired_key_reaches_its_server_and_no_other(key, tmp_path):
    good, other = OpenAIServer(), OpenAIServer()
    try:
        pairing = _pair(tmp_path / "servers.json", (good.base_url, VAR))
        run_jobs(ServerSpec(good.base_url, "test-model", api_key_env=VAR), [_job()], pairing_file=pairing)
        assert [r["headers"].get("Authorization") for r in good.requests] == [f"Bearer {KEY}"] * 2  # models + chat
        # the same name, another port (another server): refused, nothing sent
        with pytest.raises(ValueError, match="does not pair"):
            run_jobs(ServerSpec(other.base_url, "test-model", api_key_env=VAR), [_job()], pairing_file=pairing)
        assert other.connections == 0
        # a path outside the paired prefix, another variable name: refused too
        for url, var in ((good.base_url.replace("/v1", "/v2"), VAR), (good.base_url, "HF_TOKEN")):
            with pytest.raises(ValueError, match="does not pair"):
                run_jobs(ServerSpec(url, "test-model", api_key_env=var), [_job()], pairing_file=pairing)
        assert len(good.requests) == 2
        # no key named: nothing sent as Authorization, whatever the pairing
        run_jobs(ServerSpec(good.base_url, "test-model", api="vllm"), [_job()], pairing_file=pairing)
        assert "Authorization" not in good.requests[-1]["headers"]
    finally:
        good.stop()
        other.stop()


@pytest.mark.parametrize("url", ["http://user:pw@127.0.0.1:9/v1", "http://127.0.0.1:9/v1?key=abc",
                                 "http://127.0.0.1:9/v1#k", "http://127.0.0.1:9/v1/../admin",
                                 "http://127.0.0.1:9/v1/%2e%2e/x", "http://127.0.0.1:9/v1\r\nX: y", "ftp://h/v1"])
def test_urls_with_credentials_or_tricks_are_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        parse_url(url)
    with pytest.raises(ValueError):
        run_jobs(ServerSpec(url, "m"), [_job()], pairing_file="unused")


def test_a_bad_pairing_file_is_named(tmp_path, key):
    bad = tmp_path / "servers.json"
    for text, words in (("{not json", "not valid JSON"), ('{"servers": {}}', '"servers" list'),
                        ('{"servers": [{"base_url": "http://h/v1", "api_key_env": "sk-abc"}]}', "NAME"),
                        ('{"servers": [{"base_url": "http://u:p@h/v1", "api_key_env": "X"}]}', "credentials")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=words) as err:
            run_jobs(ServerSpec("http://127.0.0.1:9/v1", "m", api_key_env=VAR), [_job()], pairing_file=str(bad))
        assert str(bad) in str(err.value)


def test_redaction_oracle_on_random_texts():
    """``Secret.redact`` against the brute-force oracle: no MIN_PIECE-character piece survives, and text
    holding no piece comes back unchanged."""
    import random

    rng = random.Random(7)
    s = Secret(KEY)
    for _ in range(300):
        parts = []
        for _ in range(rng.randrange(1, 6)):
            if rng.random() < 0.5:
                a = rng.randrange(len(KEY))
                parts.append(KEY[a:a + rng.randrange(1, 20)])
            else:
                parts.append("".join(rng.choice("abc -_xyz") for _ in range(rng.randrange(0, 12))))
        text = "".join(parts)
        out = s.redact(text)
        assert not pieces_of(KEY, out), (text, out)
        if not pieces_of(KEY, text):
            assert out == text


def test_an_echoing_server_never_shows_the_key(key, tmp_path, caplog):
    """The server puts the Authorization header in its model name, in the answer and (second prompt) in a
    long error body: no MIN_PIECE-character piece of the key in any output, status, error or log line."""
    def reply(req):
        auth = req["headers"].get("Authorization", "")
        if "second" in json.dumps(req["body"]):
            # 380 + "Bearer " puts the cut at 400 characters 13 characters into the key
            return Reply(status=400, error_body=json.dumps({"error": {"message": "x" * 380 + auth}}).encode())
        text = f'{{"rewritten_prompt": "echo {auth} {auth[10:30]}", "wh_ratio": "1:1"}}'
        return Reply(answer_events(text, reasoning=f"I saw {auth}", model=auth))

    srv = OpenAIServer(reply)
    caplog.set_level(logging.DEBUG)
    try:
        pairing = _pair(tmp_path / "servers.json", (srv.base_url, VAR))
        spec = ServerSpec(srv.base_url, "test-model", api_key_env=VAR)
        out = run_jobs(spec, [_job(), _job(prompt="second prompt")], pairing_file=pairing)
        with pytest.raises(ServerError) as err:
            run_jobs(spec, [_job(prompt="second prompt")], pairing_file=pairing)
        shown = json.dumps([[o.result.rewritten_prompt, o.result.thinking, o.result.text, o.status] for o in out])
        shown += str(err.value) + caplog.text
        assert out[0].result.parse_ok and out[1].error is not None
        assert srv.requests[-1]["headers"]["Authorization"] == f"Bearer {KEY}"  # the key did go to its server
        assert not pieces_of(KEY, shown), pieces_of(KEY, shown)
    finally:
        srv.stop()
