"""Server-sent events (the ``text/event-stream`` of OpenAI-compatible chat completions), read line by line.

Only ``data:`` fields matter to chat completions: one event is the ``data`` lines up to a blank line,
joined by newlines; ``event:``, ``id:``, ``retry:`` and ``:`` comment lines are skipped. The stream's
end marker ``[DONE]`` is reported as :data:`DONE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

#: Yielded for the ``data: [DONE]`` event that closes an OpenAI-compatible stream.
DONE = object()


def events(lines: Iterable[bytes]) -> Iterator[object]:
    """Each event's data (``str``) in order, then :data:`DONE` if the stream sent ``[DONE]``.

    ``lines``: the raw lines of the response body (bytes, with or without their line ends). Stops at
    ``[DONE]``; a stream that ends without it simply ends (the caller decides whether that is early).
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                payload = "\n".join(data)
                data = []
                if payload.strip() == "[DONE]":
                    yield DONE
                    return
                yield payload
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:  # a last event without its blank line
        payload = "\n".join(data)
        yield DONE if payload.strip() == "[DONE]" else payload
