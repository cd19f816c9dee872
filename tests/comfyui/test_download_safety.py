"""Downloads never leave a corrupt or half-written file: the real ``huggingface_hub`` client against the
local hub server misbehaving on purpose (wrong Content-Range, damaged bytes, a stalled connection),
bad head files already in place, NaN heads on the Hub, two threads and two processes fetching one
head, an expired signed CDN address, Cancel then resume (also with the oldest huggingface_hub ComfyUI
0.29.0 pulls in), a symlink at the ``.part`` path and a ``../`` shard name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from qwen35_fast.downloads import model_fetch as mf
from qwen35_fast.downloads import transfer
from safetensors.torch import load, load_file
from safetensors.torch import save as st_save

from tests.comfyui import test_model_fetch as fetch_tests
from tests.comfyui.test_model_fetch import REPO, SHARDS, expected_shapes, header_len, left_behind, mtp_bytes

hub, repo = fetch_tests.hub, fetch_tests.repo  # the local hub server and the tiny base repository on it

ROOT = Path(__file__).resolve().parents[2]
PE_NAME = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"
PE_PATH = f"text_encoders/{PE_NAME}"
HEAD = "qwen3.5_9b_mtp_head.safetensors"


class Cancelled(Exception):
    pass


def same_head(path, sd) -> bool:
    head = load_file(str(path))
    return set(head) == {k for k in sd if k.startswith("mtp.")} and all(torch.equal(head[k], sd[k]) for k in head)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 64 * 1024)  # several range requests per file


@pytest.fixture
def pe_data(hub):
    data = os.urandom(1024 * 1024 + 17)
    hub.add_repo(mf.PE_REPO, {PE_PATH: data})
    return data


def test_wrong_content_range_is_retried_never_written(hub, repo, tmp_path, small_chunks):
    files, sd = repo
    key = (REPO, SHARDS[1])
    hub.shift[key] = [4, 1, header_len(files[SHARDS[1]])]  # one data range answered 4 bytes further on
    path = mf.fetch_mtp_head("9B", str(tmp_path / "a"), expected_shapes=expected_shapes(sd))
    assert same_head(path, sd)
    gets = [r[3] for r in hub.requests if r[0] == "GET" and r[2] == SHARDS[1]]
    assert len(gets) == len(set(gets)) + 1  # the mislabelled range was asked again

    hub.shift[key] = [4, 99, header_len(files[SHARDS[1]])]  # a mirror that is always off
    dest = tmp_path / "b"
    with pytest.raises(mf.FetchError, match="Content-Range 'bytes .*Run again to resume"):
        mf.fetch_mtp_head("9B", str(dest), retries=2)
    assert left_behind(dest) == [HEAD + ".part", HEAD + ".part.sums"]  # kept to resume, with its ledger
    part = (dest / (HEAD + ".part")).read_bytes()
    assert len(part) == header_len(part)  # the header it wrote, not one byte of the wrong answers


def test_damaged_bytes_with_the_right_content_range_fail_the_sha256(hub, pe_data, tmp_path):
    hub.flip.add((mf.PE_REPO, PE_PATH))
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match="does not match the Hub's sha256.*removed, run again"):
        mf.fetch_pe_file(PE_NAME, str(dest))
    assert left_behind(dest) == []
    assert Path(mf.fetch_pe_file(PE_NAME, str(dest))).read_bytes() == pe_data


def test_an_expired_signed_address_is_resolved_again_once(hub, pe_data, tmp_path, small_chunks, caplog):
    hub.signed[(mf.PE_REPO, PE_PATH)] = [3, 1000]  # the first CDN address expires after 3 range reads
    with caplog.at_level(logging.INFO, logger=transfer.__name__):
        path = mf.fetch_pe_file(PE_NAME, str(tmp_path / "te"))
    assert Path(path).read_bytes() == pe_data and left_behind(tmp_path / "te") == [PE_NAME]  # sha256-checked
    assert hub.expired == 1 and hub.bytes_of(mf.PE_REPO) == len(pe_data)  # nothing fetched twice
    assert sum("resolved it again" in r.getMessage() for r in caplog.records) == 1
    assert all(r[4] is None for r in hub.requests if r[0] == "GET")  # no token sent to the CDN


def test_a_signed_address_that_stays_expired_names_the_cause(hub, pe_data, tmp_path, small_chunks):
    key = (mf.PE_REPO, PE_PATH)
    hub.signed[key] = [2, 0]  # expires after 2 range reads; every fresh address is expired already
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match="signed download address.*HTTP 403.*expires before it can be used") as err:
        mf.fetch_pe_file(PE_NAME, str(dest))
    assert "terms" not in str(err.value) and hub.expired == 2  # resolved again once, then the cause named
    hub.signed[key] = [1000]
    assert Path(mf.fetch_pe_file(PE_NAME, str(dest))).read_bytes() == pe_data  # the next run resumes
    assert hub.bytes_of(mf.PE_REPO) == len(pe_data)


def _rewrite(path: Path, edit, record: bool = True) -> None:
    """Rewrite a head file: ``edit(header, data) -> data``, then record the new data's sha256."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = edit(header, raw[8 + n:])
    if record:
        header["__metadata__"]["data_sha256"] = hashlib.sha256(data).hexdigest()
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _dtype(header, data):
    name = next(k for k in sorted(header) if k != "__metadata__")
    header[name]["dtype"] = {"F32": "I32", "BF16": "I16", "F16": "I16"}[header[name]["dtype"]]  # same byte size
    return data


def _extra(header, data):
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["mtp.extra.weight"] = {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 8]}
    return data + bytes(8)


def _float_offsets(header, data):
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [float(o) for o in v["data_offsets"]]
    return data


def _overlap(header, data):
    first, second = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")[:2]
    size = header[second[1]]["data_offsets"][1] - header[second[1]]["data_offsets"][0]
    header[second[1]]["data_offsets"] = [second[0] - 2, second[0] - 2 + size]
    return data


def _no_checksum(header, data):
    header["__metadata__"].pop("data_sha256")
    return data


@pytest.mark.parametrize("damage,match", [
    (_dtype, "stored as I(16|32), not a float dtype"), (_extra, "'mtp.extra.weight', which is not part"),
    (_float_offsets, "malformed"), (lambda h, d: d + bytes(8), "8 bytes follow the last tensor"),
    (_overlap, "overlaps the tensor before it"), ("no checksum", "carries no checksum"),
    ("changed", "changed since it was written"),
])
def test_a_bad_head_in_place_is_named_with_delete_it(hub, repo, tmp_path, damage, match):
    files, sd = repo
    dest = tmp_path / "te"
    path = Path(mf.fetch_mtp_head("9B", str(dest)))
    if damage == "no checksum":
        _rewrite(path, _no_checksum, record=False)
    elif damage == "changed":
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(bytes(raw))
    else:
        _rewrite(path, damage)
    with pytest.raises(mf.FetchError, match=match) as err:
        mf.fetch_mtp_head("9B", str(dest), expected_shapes=expected_shapes(sd))
    assert str(path) in str(err.value) and "delete it" in str(err.value).lower()


def test_a_head_with_nan_on_the_hub_is_refused_before_the_rename(hub, repo, tmp_path):
    files, sd = repo
    shard = load(files[SHARDS[1]])
    shard["mtp.fc.weight"][0, 0] = float("nan")
    hub.set_file(REPO, SHARDS[1], st_save(shard))
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match="'mtp.fc.weight' holds NaN or infinite values.*removed"):
        mf.fetch_mtp_head("9B", str(dest))
    assert left_behind(dest) == []


def test_two_threads_fetch_one_head_once(hub, repo, tmp_path, small_chunks):
    files, sd = repo
    hub.pause[(REPO, SHARDS[1])] = 0.05  # a slow link: the second fetch arrives while the first runs
    start = threading.Barrier(2)
    out, errors = [], []

    def fetch():
        start.wait()
        try:
            out.append(mf.fetch_mtp_head("9B", str(tmp_path / "te"), expected_shapes=expected_shapes(sd)))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(out) == 2 and out[0] == out[1]
    assert hub.bytes_of(REPO, SHARDS[1]) == header_len(files[SHARDS[1]]) + mtp_bytes(sd)  # fetched once
    assert same_head(out[0], sd)


_FETCH_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from _standalone import load_pack
load_pack()
from qwen35_fast.downloads import mtp_fetch
try:
    from qwen35_fast.downloads import transfer as chunks
except ImportError:
    chunks = mtp_fetch
chunks.CHUNK = 64 * 1024
print(mtp_fetch.fetch_mtp_head("9B", sys.argv[2]))
"""


def test_two_processes_fetch_one_head_once(hub, repo, tmp_path):
    files, sd = repo
    hub.pause[(REPO, SHARDS[1])] = 0.3  # long enough for the later process to find the first one fetching
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_testtoken", HF_HOME=str(tmp_path / "hf"))
    dest = tmp_path / "te"
    procs = [subprocess.Popen([sys.executable, "-c", _FETCH_SCRIPT, str(ROOT), str(dest)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert results[0][0].strip() == results[1][0].strip() == str(dest / HEAD)
    assert hub.bytes_of(REPO, SHARDS[1]) == header_len(files[SHARDS[1]]) + mtp_bytes(sd)
    assert same_head(dest / HEAD, sd)


_RESUME_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from _standalone import load_pack
load_pack()
import huggingface_hub
from qwen35_fast.downloads import model_fetch, transfer
transfer.CHUNK = 64 * 1024

class Cancelled(Exception):
    pass

def cancel_at(done, total):
    if done >= 300_000:
        raise Cancelled()

try:
    model_fetch.fetch_pe_file(sys.argv[2], sys.argv[3], progress=cancel_at)
except Cancelled:
    print("cancelled", huggingface_hub.__version__)
print(model_fetch.fetch_pe_file(sys.argv[2], sys.argv[3]))
"""


def _cancel_then_resume(hub, data, dest, python_path=None):
    """Cancel a PE download at 300 kB, then run again; the bytes the hub served in total."""
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(dest.parent / "hf"))
    if python_path:
        env["PYTHONPATH"] = python_path
    run = subprocess.run([sys.executable, "-c", _RESUME_SCRIPT, str(ROOT), PE_NAME, str(dest)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (dest / PE_NAME).read_bytes() == data and left_behind(dest) == [PE_NAME]
    return run.stdout


def test_cancel_then_resume_transfers_only_the_rest(hub, pe_data, tmp_path, small_chunks):
    dest = tmp_path / "te"
    with pytest.raises(Cancelled):
        mf.fetch_pe_file(PE_NAME, str(dest), progress=lambda d, t: (_ for _ in ()).throw(Cancelled())
                         if d >= 300_000 else None)
    parts = [n for n in left_behind(dest) if n.endswith(".part")]
    assert len(parts) == 1 and not (dest / PE_NAME).exists()
    kept = (dest / parts[0]).stat().st_size
    assert kept >= 300_000 and (dest / parts[0]).read_bytes() == pe_data[:kept]
    before = hub.bytes_of(mf.PE_REPO)
    assert Path(mf.fetch_pe_file(PE_NAME, str(dest))).read_bytes() == pe_data
    assert hub.bytes_of(mf.PE_REPO) - before == len(pe_data) - kept
    assert left_behind(dest) == [PE_NAME]


def _old_hub() -> str:
    """A folder holding huggingface_hub 0.26.0 (the oldest transformers>=4.50.3, ComfyUI 0.29.0's floor,
    accepts) and requests, installed once into the CI cache."""
    cache = Path(os.environ.get("QWEN35_FAST_CI_CACHE", Path.home() / ".cache" / "qwen35-fast-ci"))
    target = cache / f"huggingface_hub-0.26.0-py{sys.version_info[0]}.{sys.version_info[1]}"
    if not (target / ".ok").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                        str(target), "huggingface_hub==0.26.0", "requests"], check=True, timeout=300)
        (target / ".ok").touch()
    return str(target)


def test_resume_with_the_oldest_huggingface_hub_comfyui_pulls_in(hub, pe_data, tmp_path):
    dest = tmp_path / "te"
    out = _cancel_then_resume(hub, pe_data, dest, python_path=_old_hub())
    assert "cancelled 0.26.0" in out
    assert hub.bytes_of(mf.PE_REPO) == len(pe_data)  # the second run fetched only what was missing


def test_cancel_on_a_stalled_connection_returns_within_a_second(hub, pe_data, tmp_path):
    hub.stall[(mf.PE_REPO, PE_PATH)] = 200_000
    pressed = threading.Event()
    when = {}

    def press():
        hub.stalled.wait(30)
        when["pressed"] = time.monotonic()
        pressed.set()

    def check():
        if pressed.is_set():
            raise Cancelled()

    threading.Thread(target=press, daemon=True).start()
    try:
        with pytest.raises(Cancelled):
            mf.fetch_pe_file(PE_NAME, str(tmp_path / "te"), check=check)
        assert time.monotonic() - when["pressed"] < 1.0
    finally:
        hub.release.set()
    assert not (tmp_path / "te" / PE_NAME).exists()


def test_a_symlink_at_the_part_path_is_refused(hub, repo, tmp_path):
    dest = tmp_path / "te"
    dest.mkdir()
    outside = tmp_path / "outside.bin"
    (dest / (HEAD + ".part")).symlink_to(outside)  # dangling: opening it for writing would create outside
    with pytest.raises(mf.FetchError, match="symbolic link"):
        mf.fetch_mtp_head("9B", str(dest))
    assert not outside.exists()


def test_a_shard_name_leaving_the_repository_is_refused(hub, repo, tmp_path):
    files, sd = repo
    index = json.loads(files[mf.INDEX_FILE])
    index["weight_map"] = {k: ("../other/model.safetensors" if k.startswith("mtp.") else v)
                           for k, v in index["weight_map"].items()}
    hub.set_file(REPO, mf.INDEX_FILE, json.dumps(index).encode())
    with pytest.raises(mf.FetchError, match="'../other/model.safetensors', which is not a .safetensors file of"):
        mf.fetch_mtp_head("9B", str(tmp_path / "te"))
    assert not any(".." in r[2] for r in hub.requests)
