"""A logging handler that keeps each record's message (test helper, also for the child processes the
tests start: it imports nothing of the pack)."""

from __future__ import annotations

import logging


class Messages(logging.Handler):
    """Keeps ``record.getMessage()`` of every record at ``level`` or above, oldest first, in ``messages``."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())
