"""Server-sent events (``text/event-stream``) as the WHATWG HTML standard's event-stream interpretation
defines them, fed one line at a time (line ends already removed: CR LF, LF and a bare CR all end a line).

A blank line dispatches the event: its ``data`` lines joined by LF (an empty ``data:`` line counts, so
``data:`` alone gives an event whose data is ""), its type from ``event:`` (default ``"message"``).
Comment lines (``:``), ``id``, ``retry`` and unknown fields are skipped; a field without a colon has an
empty value; one space after the colon is dropped; a BOM opening the stream is dropped. An event with
no data line is not dispatched, nor is one the stream ends inside. The data of one event is bounded:
:class:`SSEError` beyond ``max_data`` characters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class SSEError(ValueError):
    """An event over the size bound."""


@dataclass(frozen=True)
class Event:
    """One dispatched event: its ``type`` (``"message"`` unless an ``event:`` line named another) and ``data``."""

    type: str
    data: str


class EventParser:
    """Feeds lines (``str``, without their line ends); :meth:`feed` returns the event a blank line
    dispatches, else None."""

    def __init__(self, max_data: int = 1 << 20):
        self.max_data = max_data
        self._data: list[str] = []
        self._size = 0
        self._type = ""
        self._first = True

    def feed(self, line: str) -> Event | None:
        if self._first:
            self._first = False
            if line.startswith("\ufeff"):
                line = line[1:]
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._size += len(value) + 1
            if self._size > self.max_data:
                raise SSEError(f"an event's data is over {self.max_data} characters")
            self._data.append(value)
        elif field == "event":
            self._type = value
        return None

    def _dispatch(self) -> Event | None:
        data, kind = self._data, self._type
        self._data, self._size, self._type = [], 0, ""
        if not data:
            return None
        return Event(kind or "message", "\n".join(data))


def events(lines: Iterable[str], max_data: int = 1 << 20) -> Iterator[Event]:
    """Each event of ``lines`` in order (see the module docstring)."""
    parser = EventParser(max_data)
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            yield event
