"""The one error type of the engine: a checkpoint, module tree or request it cannot serve."""

from __future__ import annotations


class Qwen35Error(ValueError):
    """Not Qwen3.5, a missing or misshapen tensor, a cache overflow or a bad request.

    The message names the tensor (or argument) at fault and what to do about it.
    """


def exception_line(exc: BaseException) -> str:
    """``"Type: first line of the message"`` (``"Type"`` for an empty message): an exception in one line."""
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".rstrip(": ")
