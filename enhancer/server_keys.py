"""Which API key may go to which server: the user pairs them in a file, a workflow never can.

The pairing file ``qwen35_fast_servers.json`` sits at the root of ComfyUI's user directory
(``folder_paths.get_user_directory()``), where none of ComfyUI's HTTP routes reach: ``/userdata``,
``/v2/userdata`` and ``/settings`` resolve every path inside ``<user directory>/<user>``, and ``/users``
writes only ``users.json``. It holds variable NAMES, never keys::

    {"servers": [{"base_url": "https://host:8000/v1", "api_key_env": "MY_KEY"}]}

A key is sent only when the node's endpoint has the scheme, host and port of a paired entry and its
path lies under the entry's path, and the node's ``api_key_env`` is that entry's name. A URL that
carries credentials, a query, a fragment, dot segments or escapes is refused, in the file and on the
node. :class:`Secret` holds a key for one run and redacts it, whole and in every piece of
:data:`MIN_PIECE` or more characters, from any text.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import dataclass

PAIRING_FILE = "qwen35_fast_servers.json"
MIN_PIECE = 8  # the shortest piece of a key that is redacted (shorter keys: the whole key)
MASK = "***"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]+$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Secret:
    """An API key for one run: ``header()`` for the request, ``redact(text)`` for anything shown.
    Its repr never shows the key."""

    __slots__ = ("_value", "_pieces", "_n")

    def __init__(self, value: str):
        self._value = value
        self._n = min(MIN_PIECE, len(value))
        self._pieces = {value[i:i + self._n] for i in range(len(value) - self._n + 1)}

    def header(self) -> str:
        return f"Bearer {self._value}"

    def redact(self, text: str) -> str:
        """``text`` with every run of characters that is a piece of the key (``MIN_PIECE`` or more
        characters, or the whole key when shorter) replaced by ``***``."""
        if not text or not self._pieces:
            return text
        n, hit = self._n, None
        for piece in self._pieces:
            j = text.find(piece)
            while j >= 0:
                hit = hit or bytearray(len(text))
                hit[j:j + n] = b"\x01" * n
                j = text.find(piece, j + 1)
        if hit is None:
            return text
        out, i = [], 0
        while i < len(text):
            j = hit.find(b"\x01" if not hit[i] else b"\x00", i)
            j = len(text) if j < 0 else j
            out.append(MASK if hit[i] else text[i:j])
            i = j
        return "".join(out)

    def __repr__(self) -> str:
        return "Secret(***)"


def redact(text: str, secret: Secret | None) -> str:
    """``text`` with ``secret`` redacted (``text`` itself when there is no secret)."""
    return secret.redact(text) if secret is not None else text


@dataclass(frozen=True)
class Origin:
    """Where a URL points: scheme, lower-case host, port (the scheme's default filled in), path without
    its trailing ``/``."""

    scheme: str
    host: str
    port: int
    path: str

    def covers(self, other: Origin) -> bool:
        """True when ``other`` is this origin at this path or below it."""
        return ((self.scheme, self.host, self.port) == (other.scheme, other.host, other.port)
                and (not self.path or other.path == self.path or other.path.startswith(self.path + "/")))

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_url(url, what: str = "base_url") -> Origin:
    """The :class:`Origin` of an http(s) URL; ValueError naming the fix for anything else (credentials, a
    query or fragment, control characters, dot segments or escapes in the path, a bad port)."""
    example = "e.g. http://127.0.0.1:8000/v1"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{what} is empty: write the server's OpenAI-compatible address, {example}.")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url.strip()):
        raise ValueError(f"{what} contains spaces or control characters: write a plain address, {example}.")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{what} {url!r} is not an http(s) URL: write the server's OpenAI-compatible address, "
                         f"{example} (vLLM), :30000/v1 (SGLang), :8080/v1 (llama-server), :11434/v1 (Ollama).")
    if "@" in parts.netloc:
        raise ValueError(f"{what} carries credentials (user:password@): remove them. A key goes only in an "
                         f"environment variable named in api_key_env and paired in {PAIRING_FILE}.")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"{what} carries a query or fragment (?... or #...): remove it; a key never goes in "
                         f"the URL but in an environment variable named in api_key_env and paired in {PAIRING_FILE}.")
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise ValueError(f"{what} {url!r} has a port that is not a number from 1 to 65535.") from None
    path = parts.path.rstrip("/")
    if "%" in path or "\\" in path or any(seg in (".", "..") for seg in path.split("/")):
        raise ValueError(f"{what} {url!r} has escapes or . / .. segments in its path: write the plain path, "
                         f"{example}.")
    return Origin(parts.scheme, parts.hostname.lower(), port, path)


def pairing_path(user_dir: str | None = None) -> str:
    """The pairing file's path: ``user_dir`` (default: ComfyUI's user directory) / :data:`PAIRING_FILE`."""
    if user_dir is None:
        import folder_paths

        user_dir = folder_paths.get_user_directory()
    return os.path.join(user_dir, PAIRING_FILE)


def load_pairings(path: str) -> list[tuple[Origin, str]]:
    """(origin, variable name) per entry of the pairing file (none when the file does not exist);
    ValueError naming the file and the fix for a file that cannot be used."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ValueError(f"The server pairing file {path} cannot be read ({exc.strerror}): fix its permissions.") \
            from None
    shape = ('{"servers": [{"base_url": "https://host:8000/v1", "api_key_env": "MY_KEY"}]}')
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"The server pairing file {path} is not valid JSON ({exc}): write it as {shape}.") from None
    servers = data.get("servers") if isinstance(data, dict) else None
    if not isinstance(servers, list):
        raise ValueError(f"The server pairing file {path} has no \"servers\" list: write it as {shape}.")
    out = []
    for i, entry in enumerate(servers):
        where = f"entry {i + 1} of \"servers\" in {path}"
        if not isinstance(entry, dict) or not isinstance(entry.get("base_url"), str) \
                or not isinstance(entry.get("api_key_env"), str):
            raise ValueError(f"{where} needs \"base_url\" and \"api_key_env\" strings, as in {shape}.")
        name = entry["api_key_env"].strip()
        if not _ENV_NAME.match(name):
            raise ValueError(f"{where}: api_key_env must be the NAME of an environment variable (letters, digits, "
                             "_), never the key itself.")
        out.append((parse_url(entry["base_url"], what=f"The base_url of {where}"), name))
    return out


def key_for(endpoint: str, api_key_env: str, pairing_file: str) -> Secret | None:
    """The key to send to ``endpoint`` (None when ``api_key_env`` is empty). Checked before any connection:
    ValueError naming the fix for a name that is not a variable name, an unpaired name or host (the entry
    to add), or a variable that is unset or not usable in a header."""
    name = (api_key_env or "").strip()
    if not name:
        return None
    if not _ENV_NAME.match(name):
        raise ValueError(f"api_key_env must be the NAME of an environment variable (letters, digits, _), not the "
                         f"key itself; got a value of {len(name)} characters.")
    origin = parse_url(endpoint)
    if not any(name == var and paired.covers(origin) for paired, var in load_pairings(pairing_file)):
        entry = json.dumps({"base_url": origin.url(), "api_key_env": name})
        raise ValueError(
            f"api_key_env names {name}, but {pairing_file} does not pair {name} with {origin.url()}, so nothing "
            f"was sent. A workflow cannot choose where a key goes; you do, outside it: if you trust this server "
            f"with {name}, add {entry} to the \"servers\" list of that file (create it as {{\"servers\": "
            f"[{entry}]}}), then run again. For a server without a key, clear api_key_env.")
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"The environment variable {name} (api_key_env) is not set in ComfyUI's environment: set "
                         f"{name} to the server's API key before starting ComfyUI, or clear api_key_env for a server "
                         "without a key.")
    if not _HEADER_SAFE.match(value):
        raise ValueError(f"The environment variable {name} holds spaces, line breaks or non-ASCII characters, which "
                         "an HTTP header cannot carry: set it to the key alone.")
    return Secret(value)
