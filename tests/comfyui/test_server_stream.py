"""The server enhancer stops when told and by itself, reads the stream as the SSE standard says, and checks
inputs and replies per prompt. Real loopback HTTP servers (``tests/openai_server.py``) stream at 5,000
events a second, frame their bodies three ways, never accept a connection, ignore max_tokens, send lines
without end, malformed chunks; the run is driven through ``run_jobs`` with a ``Hooks`` whose Cancel is a
flag, as ComfyUI's is (``ComfyHooks``; ``test_pe_server.py`` cancels through a real ComfyUI server)."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest
from qwen35_fast.enhancer import server_probe, sse
from qwen35_fast.enhancer.server_api import ServerError, ServerSpec
from qwen35_fast.enhancer.server_enhancer import Hooks, ServerJob, run_jobs

from tests.openai_server import Blackhole, OpenAIServer, Reply, answer_events, chunk

ANSWER = '{"rewritten_prompt": "a red fox asleep in snow", "wh_ratio": "16:9"}'


class Cancelled(Exception):
    pass


class CancelAfter(Hooks):
    """Cancel ``after_s`` seconds into the run (a timer thread sets the flag, as ComfyUI's /interrupt does)."""

    def __init__(self, after_s: float):
        self.flag, self.at = threading.Event(), None
        self.updates = 0
        threading.Timer(after_s, self._cancel).start()

    def _cancel(self):
        self.at = time.perf_counter()
        self.flag.set()

    def update(self, done, total, text):
        self.updates = done

    def check(self):
        if self.flag.is_set():
            raise Cancelled()

    def stopped(self):
        return self.flag.is_set()


@pytest.fixture(autouse=True)
def _fresh_probe():
    server_probe.forget()
    yield
    server_probe.forget()


def _job(**kw) -> ServerJob:
    return ServerJob(kw.pop("prompt", "a fox in snow"), system_prompt="Rewrite the prompt.", **kw)


def _run(srv_or_url, jobs, hooks=None, **spec):
    url = getattr(srv_or_url, "base_url", srv_or_url)
    return run_jobs(ServerSpec(url, "test-model", **spec), jobs, hooks, pairing_file="/nonexistent/servers.json")


def _pe_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("qwen35-pe") and t.is_alive()]


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_cancel_at_5000_events_a_second_closes_the_connection(framing):
    srv = OpenAIServer(lambda req: Reply(framing=framing, rate=5000, endless_event=chunk("x")))
    try:
        hooks = CancelAfter(0.6)
        with pytest.raises(Cancelled):
            _run(srv, [_job(max_length=65536)], hooks, api="vllm")
        returned = time.perf_counter() - hooks.at
        assert srv.closed.wait(1.0), "the server never saw the connection closed"
        seen = srv.closed_at - hooks.at
        print(f"{framing}: returned {returned * 1000:.0f} ms after Cancel, server saw it closed after "
              f"{seen * 1000:.0f} ms, {srv.sent_events} events sent, {hooks.updates} shown")
        assert returned < 1.0 and seen < 1.0
        assert hooks.updates > 100  # the fast stream did reach the caller before Cancel
        time.sleep(0.2)
        assert not _pe_threads()
    finally:
        srv.stop()


@pytest.mark.parametrize("api", ["vllm", "auto"])
def test_cancel_while_connecting(api):
    hole = Blackhole()
    try:
        hooks = CancelAfter(0.5)
        start = time.perf_counter()
        with pytest.raises(Cancelled):
            _run(hole, [_job()], hooks, api=api, timeout_s=60)
        returned = time.perf_counter() - hooks.at
        print(f"api {api}: returned {returned * 1000:.0f} ms after Cancel ({time.perf_counter() - start:.2f} s in all)")
        assert returned < 1.0
        time.sleep(0.2)
        assert not _pe_threads()
        assert hole.queued() == 1  # only the filler the queue holds: the abandoned connect never completed
    finally:
        hole.stop()


def test_a_server_ignoring_max_tokens_is_cut_at_max_length():
    srv = OpenAIServer(lambda req: Reply(rate=5000, endless_event=chunk("tok ")))
    try:
        out = _run(srv, [_job(max_length=64, thinking=False)], api="vllm", deadline_s=5)
        r = out[0].result
        assert srv.chat_requests()[0]["body"]["max_tokens"] == 64
        assert r.stats.tokens == 64 and r.stats.content == "tok " * 64
        assert out[0].status[0].startswith("Cut at max_length 64"), out[0].status
        assert srv.closed.wait(1.0)
        assert srv.sent_events < 5000  # stopped reading at once, not after the server's thousands
    finally:
        srv.stop()


def test_a_server_flushing_a_few_deltas_past_max_length_is_not_cut():
    """A server may send one token's text in several deltas (transformers serve flushes held bytes): a few
    past max_length, then its finish, are all kept; the 17th past it closes the stream (64 kept)."""
    text = "ab" * 67  # 67 deltas of 2 characters for max_length 64, then finish and usage
    srv = OpenAIServer(lambda req: Reply([chunk(text[i:i + 2]) for i in range(0, len(text), 2)]
                                         + [chunk(finish="length"), "[DONE]"]))
    many = OpenAIServer(lambda req: Reply([chunk("ab")] * (64 + 17) + [chunk(finish="length"), "[DONE]"]))
    try:
        out = _run(srv, [_job(max_length=64, thinking=False)], api="vllm")
        assert out[0].result.stats.content == text and out[0].result.stats.cut is None
        assert out[0].status[0].startswith("Stopped at max_length 64 (finish 'length')"), out[0].status
        cut = _run(many, [_job(max_length=64, thinking=False)], api="vllm")[0].result.stats
        assert cut.cut == "max_length" and cut.content == "ab" * 64
    finally:
        srv.stop()
        many.stop()


def test_deadline_and_per_read_timeout():
    srv = OpenAIServer(lambda req: Reply(rate=200, endless_event=chunk("")))  # events without text, forever
    stall = OpenAIServer(lambda req: Reply(events=[chunk("a")], delay_s=3))
    try:
        start = time.perf_counter()
        with pytest.raises(ServerError, match=r"did not finish within 1 s \(deadline_s\)"):
            _run(srv, [_job()], api="vllm", deadline_s=1)
        assert time.perf_counter() - start < 2
        with pytest.raises(ServerError, match=r"sent nothing for 1 s \(timeout_s\)"):
            _run(stall, [_job()], api="vllm", timeout_s=1)
    finally:
        srv.stop()
        stall.stop()


def test_a_line_without_end_is_refused_in_small_memory():
    endless = b"data: " + b"x" * (64 << 20)  # 64 MiB and no line end
    srv = OpenAIServer(lambda req: Reply(raw=endless, framing="close"))
    try:
        tracemalloc.start()
        with pytest.raises(ServerError, match="over 1 MiB"):
            _run(srv, [_job()], api="vllm")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"peak traced memory {peak / 2**20:.1f} MiB")
        assert peak < 16 << 20
    finally:
        srv.stop()


# -- the event stream as the standard defines it

def test_sse_parser_against_the_standard():
    """Oracle: the WHATWG HTML standard's event-stream examples and rules."""
    def parse(text):
        import re
        lines = re.split(r"\r\n|\r|\n", text)[:-1]  # the standard's line ends; an unterminated tail is no line
        return [(e.type, e.data) for e in sse.events(lines)]

    # "data: YHOO\ndata: +2\ndata: 10\n\n": one event, lines joined by LF
    assert parse("data: YHOO\ndata: +2\ndata: 10\n\n") == [("message", "YHOO\n+2\n10")]
    # the standard's four-block example: comment, two events, one without a blank line at the end
    assert parse(": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event") == \
        [("message", "first event"), ("message", "second event")]
    # "data\n\ndata\ndata\n\ndata:": an empty event, then one of a single LF; the last is not dispatched
    assert parse("data\n\ndata\ndata\n\ndata:") == [("message", ""), ("message", "\n")]
    # an event the stream ends inside (no blank line after it) is not dispatched
    assert parse("data: a\n\ndata: b\n") == [("message", "a")]
    # "data:test" and "data: test" are the same; bare CR and CR LF end lines too; a BOM is dropped
    assert parse("\ufeffdata:test\r\rdata: test\r\n\r\nevent: error\ndata: {}\n\n") == \
        [("message", "test"), ("message", "test"), ("error", "{}")]


def test_a_stream_with_cr_line_ends_comments_and_empty_events_reads_whole():
    body = b": keep-alive\r\r"
    body += b"data:\r\r"  # an empty data event (skipped: no chunk in it)
    for e in answer_events(ANSWER, reasoning="thinking it over"):
        payload = e if isinstance(e, str) else json.dumps(e, indent=1)  # multi-line data
        body += b"".join(b"data: " + line.encode() + b"\r" for line in payload.split("\n")) + b"\r"
    srv = OpenAIServer(lambda req: Reply(raw=body, framing="length"))
    try:
        out = _run(srv, [_job()], api="vllm")
        assert out[0].result.rewritten_prompt == "a red fox asleep in snow" and out[0].result.parse_ok
        assert out[0].result.thinking == "thinking it over"
    finally:
        srv.stop()


def test_a_whole_answer_in_content_only_is_kept():
    srv = OpenAIServer(lambda req: Reply(answer_events(ANSWER)))
    try:
        r = _run(srv, [_job(thinking=True)], api="vllm")[0].result
        assert r.parse_ok and r.rewritten_prompt == "a red fox asleep in snow" and r.wh_ratio == "16:9"
    finally:
        srv.stop()


# -- malformed replies, bad inputs, lists

MALFORMED = {
    "a chunk that is not JSON": ["{oops"],
    "a chunk that is not a JSON object": [[1, 2]],
    "choices that are not a list of objects": [{"choices": "abc"}, {"choices": [1]}],
    "a delta of the wrong shape": [{"choices": [{"delta": "x"}]}, {"choices": [{"delta": {}, "finish_reason": 3}]}],
    "content text that is not a string": [{"choices": [{"delta": {"content": 5}}]}],
    "reasoning text that is not a string": [{"choices": [{"delta": {"reasoning_content": ["a"]}}]}],
    "a usage record of the wrong shape": [{"usage": 7}, {"usage": {"completion_tokens": "12"}}],
}


def test_malformed_replies_get_named_errors():
    for what, chunks in MALFORMED.items():
        for bad in chunks:
            events = [json.dumps(bad) if not isinstance(bad, str) else bad, "[DONE]"]
            srv = OpenAIServer(lambda req, events=events: Reply(events))
            try:
                with pytest.raises(ServerError) as err:
                    _run(srv, [_job()], api="vllm")
                assert what in str(err.value), (bad, str(err.value))
            finally:
                srv.stop()


@pytest.mark.parametrize("bad, words", [
    (dict(megapixels=float("nan")), "megapixels must be a number"),
    (dict(megapixels=-1.0), "megapixels must be a number"),
    (dict(seed=2**31), "seed must be an integer from 0 to 2147483647"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(preset="custom", custom=dict(temperature=float("nan"), top_k=20, top_p=0.95, min_p=0.0,
                                       presence_penalty=0.0)), "temperature must be a finite number"),
    (dict(preset="custom", custom=dict(temperature=1.0, top_k=-1, top_p=0.95, min_p=0.0,
                                       presence_penalty=0.0)), "top_k must be an integer >= 0"),
    (dict(preset="custom", custom=dict(temperature=1.0, top_k=20, top_p=0.0, min_p=0.0,
                                       presence_penalty=0.0)), "top_p must be in"),
    (dict(preset="custom", custom=dict(temperature=1.0, top_k=20, top_p=0.9, min_p=float("nan"),
                                       presence_penalty=0.0)), "min_p must be in"),
    (dict(preset="custom", custom=dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.0,
                                       presence_penalty=float("inf"))), "presence_penalty must be a finite"),
])
def test_bad_inputs_are_refused_before_any_request(bad, words):
    srv = OpenAIServer()
    try:
        with pytest.raises(ValueError, match=words):
            _run(srv, [_job(**bad)], api="vllm")
        assert srv.requests == []
    finally:
        srv.stop()


def test_in_a_list_a_bad_item_fails_alone():
    """Prompt 2 has NaN megapixels (never sent), prompt 4 gets a malformed reply: 1 and 3 keep their answers."""
    def reply(req):
        if "prompt four" in json.dumps(req["body"]):
            return Reply(["{broken", "[DONE]"])
        return Reply(answer_events(ANSWER))

    srv = OpenAIServer(reply)
    try:
        jobs = [_job(prompt="prompt one"), _job(prompt="prompt two", megapixels=float("nan")),
                _job(prompt="prompt three"), _job(prompt="prompt four")]
        out = _run(srv, jobs, api="vllm")
        assert [o.result.parse_ok for o in out] == [True, False, True, False]
        assert [o.result.rewritten_prompt for o in out] == ["a red fox asleep in snow", "prompt two",
                                                            "a red fox asleep in snow", "prompt four"]
        assert out[1].status[0].startswith("Prompt 2 of 4 failed") and "megapixels" in out[1].status[0]
        assert out[3].status[0].startswith("Prompt 4 of 4 failed") and "not JSON" in out[3].status[0]
        # NaN megapixels: 1:1 at 1 MP, 1000 x 1000 pixels, each side rounded to the nearest multiple of 16
        assert (out[1].result.width, out[1].result.height) == (1008, 1008)
        assert len(srv.chat_requests()) == 3  # the NaN prompt never went out
    finally:
        srv.stop()


def test_unknown_fields_refused_name_the_api_input():
    """A server that refuses fields it does not know (as transformers serve does) names api and the fields."""
    def reply(req):
        extra = sorted(set(req["body"]) - {"model", "messages", "stream", "max_tokens", "seed", "temperature",
                                           "top_p"})
        return Reply(status=422, error_body=json.dumps(
            {"detail": f"Unexpected fields in the request: {set(extra)}"}).encode())

    srv = OpenAIServer(reply)
    try:
        with pytest.raises(ServerError) as err:
            _run(srv, [_job()], api="vllm")
        msg = str(err.value)
        assert "api input ('vllm')" in msg and "top_k" in msg and "min_p" in msg, msg
    finally:
        srv.stop()


def test_auto_asks_once_and_sends_only_honoured_fields():
    srv = OpenAIServer(owner="someone")  # not a known owner: 404 on /api/version and /openapi.json
    try:
        out = _run(srv, [_job()], api="auto")
        _run(srv, [_job()], api="auto")
        gets = [r["path"] for r in srv.requests if r["method"] == "GET"]
        assert gets == ["/v1/models", "/api/version", "/openapi.json"]  # asked once for both runs
        body = srv.chat_requests()[0]["body"]
        assert not {"top_k", "min_p", "chat_template_kwargs"} & set(body)  # the OpenAI standard fields only
        assert any(line.startswith("api auto: openai") for line in out[0].status)
    finally:
        srv.stop()
