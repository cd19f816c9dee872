"""Downloads certify only bytes that were checked (the real ``huggingface_hub`` client against the
local hub server): another version's bytes served under this file's headers and an honest
``Content-Range`` are refused for a whole file (the Hub's sha256) and never certified as the Hub's
for a head read by ranges; a resumed ``.part`` is re-read and checked against its ledger before
any of it is trusted; a part written over during the download is refused; planted symbolic links
at every part, ledger and lock path are never followed; the lock keeps one writer while its file
is removed at the end of every download (success, failure, Cancel).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from qwen35_fast.downloads import file_lock, head_check, part_file
from qwen35_fast.downloads import model_fetch as mf
from safetensors.torch import load, load_file
from safetensors.torch import save as st_save

from tests.comfyui import test_download_safety as safety
from tests.comfyui import test_model_fetch as fetch_tests
from tests.comfyui.test_model_fetch import REPO, SHARDS, expected_shapes, header_len, left_behind

hub, repo = fetch_tests.hub, fetch_tests.repo
pe_data, small_chunks = safety.pe_data, safety.small_chunks
PE_NAME, PE_PATH, HEAD = safety.PE_NAME, safety.PE_PATH, safety.HEAD
RUN = 64 * 1024  # bytes per range request and ledger line (small_chunks)
ROOT = Path(__file__).resolve().parents[2]


class Cancelled(Exception):
    pass


def cancel_at(nbytes: int):
    def progress(done, total):
        if done >= nbytes:
            raise Cancelled()
    return progress


def data_section(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[header_len(raw):]


def other_shard(files, sd) -> bytes:
    """Another version of the second shard: same header (names, dtypes, shapes), other mtp.* values."""
    shard = load(files[SHARDS[1]])
    for k in shard:
        if k.startswith("mtp."):
            shard[k] = shard[k] * 0.5 + 0.01
    other = st_save(shard)
    assert header_len(other) == header_len(files[SHARDS[1]]) and len(other) == len(files[SHARDS[1]])
    return other


def test_other_bytes_under_an_honest_content_range_fail_a_whole_file(hub, pe_data, tmp_path, small_chunks):
    other = bytes(b ^ 0x5A for b in pe_data)
    hub.swap[(mf.PE_REPO, PE_PATH)] = [other, 3]  # three range replies from a stale copy, headers as asked
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match="does not match the Hub's sha256.*removed, run again"):
        mf.fetch_pe_file(PE_NAME, str(dest))
    assert left_behind(dest) == []  # nothing published, no part, ledger or lock
    assert Path(mf.fetch_pe_file(PE_NAME, str(dest))).read_bytes() == pe_data


def test_a_head_read_from_other_bytes_is_never_certified_as_the_hubs(hub, repo, tmp_path, caplog):
    """Range reads of another version's bytes under honest headers cannot be told from the Hub's (its
    sha256 covers whole shards): the head keeps what it got, and its checksum vouches for no more
    than that, saying so in the file."""
    files, sd = repo
    other = other_shard(files, sd)
    hub.swap[(REPO, SHARDS[1])] = [other, 999]
    with caplog.at_level(logging.INFO, logger=mf.__name__.rsplit(".", 1)[0]):
        path = Path(mf.fetch_mtp_head("9B", str(tmp_path / "te"), expected_shapes=expected_shapes(sd)))
    got, served = load_file(str(path)), load(other)
    assert all(got[k].equal(served[k]) for k in got)  # what arrived (wrong, and undetectable here)
    meta = json.loads(path.read_bytes()[8:header_len(path.read_bytes())])["__metadata__"]
    assert meta["data_sha256"] == hashlib.sha256(data_section(path)).hexdigest()  # the bytes as received
    assert head_check.source_unchecked(str(path)) == meta["data_checked"] == head_check.RANGES_CHECKED
    assert "not the Hub's sha256" in meta["data_checked"]
    assert any("not the Hub's sha256" in r.getMessage() for r in caplog.records)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        c = f.read(1)
        f.seek(at)
        f.write(bytes([c[0] ^ 0xFF]))


def test_a_corrupted_resumed_part_of_a_whole_file_is_checked_then_fetched_again(hub, pe_data, tmp_path,
                                                                                small_chunks, caplog):
    dest = tmp_path / "te"
    with pytest.raises(Cancelled):
        mf.fetch_pe_file(PE_NAME, str(dest), progress=cancel_at(300_000))
    (part,) = [dest / n for n in left_behind(dest) if n.endswith(".part")]
    kept = part.stat().st_size
    _flip(part, RUN + 100)  # inside the second run of the ledger
    before = hub.bytes_of(mf.PE_REPO)
    with caplog.at_level(logging.WARNING):
        assert Path(mf.fetch_pe_file(PE_NAME, str(dest))).read_bytes() == pe_data
    assert kept > 2 * RUN and hub.bytes_of(mf.PE_REPO) - before == len(pe_data) - RUN  # from the damaged run on
    assert any("differ from what was received" in r.getMessage() for r in caplog.records)
    assert left_behind(dest) == [PE_NAME]


@pytest.mark.parametrize("damage", ["flipped byte", "ledger lost", "ledger line garbled"])
def test_a_corrupted_resumed_part_of_a_head_is_checked_then_fetched_again(hub, repo, tmp_path, small_chunks,
                                                                          monkeypatch, damage):
    from qwen35_fast.downloads import hub_client, transfer

    files, sd = repo
    monkeypatch.setattr(transfer, "MIB", 4096)  # progress (and so Cancel) every 4 KiB
    monkeypatch.setattr(hub_client, "_BLOCK", 4096)
    dest = tmp_path / "te"
    with pytest.raises(Cancelled):
        mf.fetch_mtp_head("9B", str(dest), progress=cancel_at(2 * RUN + 1))
    part, sums = dest / (HEAD + ".part"), dest / (HEAD + ".part.sums")
    base = header_len(part.read_bytes())
    assert part.stat().st_size - base > 2 * RUN and len(sums.read_bytes().splitlines()) == 3
    good = RUN  # the runs before the damage, kept
    if damage == "flipped byte":
        _flip(part, base + RUN + 7)  # a byte of the second run
    elif damage == "ledger lost":
        sums.unlink()
        good = 0
    else:
        lines = sums.read_bytes().splitlines(keepends=True)
        sums.write_bytes(lines[0] + b"garbage\n" + b"".join(lines[2:]))
    before = hub.bytes_of(REPO, SHARDS[1])
    path = Path(mf.fetch_mtp_head("9B", str(dest), expected_shapes=expected_shapes(sd)))
    total = sum(t.numel() * t.element_size() for k, t in sd.items() if k.startswith("mtp."))
    assert hub.bytes_of(REPO, SHARDS[1]) - before == header_len(files[SHARDS[1]]) + total - good
    head = load_file(str(path))
    assert set(head) == {k for k in sd if k.startswith("mtp.")} and all(head[k].equal(sd[k]) for k in head)
    true_data = b"".join(sd[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                         for k in sorted(head, key=lambda k: _offset(path, k)))
    meta = json.loads(path.read_bytes()[8:header_len(path.read_bytes())])["__metadata__"]
    assert meta["data_sha256"] == hashlib.sha256(true_data).hexdigest()
    assert left_behind(dest) == [HEAD]


def _offset(path: Path, name: str) -> int:
    raw = path.read_bytes()
    return json.loads(raw[8:header_len(raw)])[name]["data_offsets"][0]


@pytest.mark.parametrize("what", ["head", "whole file"])
def test_a_part_written_over_during_the_download_is_refused(hub, repo, pe_data, tmp_path, small_chunks, what):
    """Bytes the ledger already holds, changed on disk before the end: the file is compared with the
    bytes received before anything is recorded or renamed."""
    dest = tmp_path / "te"
    state = {"done": False}

    def progress(done, total):
        if done > 2 * 4096 and not state["done"]:
            state["done"] = True
            (part,) = [dest / n for n in os.listdir(dest) if n.endswith(".part")]
            _flip(part, part.stat().st_size - 4096)

    with pytest.raises(mf.FetchError, match="differs from the bytes received.*removed, run again"):
        if what == "head":
            mf.fetch_mtp_head("9B", str(dest), progress=progress)
        else:
            mf.fetch_pe_file(PE_NAME, str(dest), progress=progress)
    assert state["done"] and left_behind(dest) == []


def _run_head(dest, outcome, hub, files):
    if outcome == "failure":  # NaN in the head: refused once it is downloaded
        shard = load(files[SHARDS[1]])
        shard["mtp.fc.weight"][0, 0] = float("nan")
        hub.set_file(REPO, SHARDS[1], st_save(shard))
    return mf.fetch_mtp_head("9B", str(dest), progress=_watch(dest, outcome))


def _run_pe(dest, outcome, hub, files):
    if outcome == "failure":
        hub.flip.add((mf.PE_REPO, PE_PATH))  # sha256 mismatch at the end
    return mf.fetch_pe_file(PE_NAME, str(dest), progress=_watch(dest, outcome))


_LOCKS_SEEN: list[bool] = []


def _watch(dest, outcome):
    def progress(done, total):
        _LOCKS_SEEN.append(any(n.endswith(".lock") for n in os.listdir(dest)))
        if outcome == "cancel" and done >= 100_000:
            raise Cancelled()
    return progress


@pytest.mark.parametrize("outcome", ["success", "failure", "cancel"])
@pytest.mark.parametrize("run", [_run_head, _run_pe], ids=["head", "whole file"])
def test_no_lock_file_stays_in_the_model_folder(hub, repo, pe_data, tmp_path, small_chunks, run, outcome):
    files, _ = repo
    dest = tmp_path / "te"
    _LOCKS_SEEN.clear()
    if outcome == "success":
        run(dest, outcome, hub, files)
    else:
        with pytest.raises(Cancelled if outcome == "cancel" else mf.FetchError):
            run(dest, outcome, hub, files)
    assert _LOCKS_SEEN and all(_LOCKS_SEEN)  # the lock file was there while the download ran
    assert not [n for n in left_behind(dest) if n.endswith(".lock")], left_behind(dest)


def test_no_lock_file_stays_after_a_system_prompt_download(hub, tmp_path):
    hub.add_repo("Qwen/Qwen-Image-2.1-PE-T2I", {mf.PROMPT_FILE: b"You enhance prompts.\n"})
    models = tmp_path / "models"
    assert mf.official_system_prompt("text-to-image", str(models)) == "You enhance prompts."
    folder = Path(mf.prompt_path("text-to-image", str(models))).parent
    assert left_behind(folder) == [mf.PROMPT_FILE]


def _plant(tmp_path, dest: Path, names: list[str]) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    links = []
    for i, name in enumerate(names):
        link = dest / name
        link.symlink_to(tmp_path / f"outside{i}")  # dangling: writing through it would create the target
        links.append(link)
    return links


@pytest.mark.parametrize("where", ["head ledger", "head lock", "whole-file part", "whole-file lock"])
def test_a_symlink_at_a_part_ledger_or_lock_path_is_refused(hub, repo, pe_data, tmp_path, where):
    dest = tmp_path / "te"
    etag = hashlib.sha256(pe_data).hexdigest()[:16]
    name = {"head ledger": HEAD + ".part.sums", "head lock": HEAD + ".lock",
            "whole-file part": f"{PE_NAME}.{etag}.part", "whole-file lock": PE_NAME + ".lock"}[where]
    _plant(tmp_path, dest, [name])
    with pytest.raises(mf.FetchError, match="symbolic link"):
        if where.startswith("head"):
            mf.fetch_mtp_head("9B", str(dest))
        else:
            mf.fetch_pe_file(PE_NAME, str(dest))
    assert not list(tmp_path.glob("outside*"))


def test_the_system_prompt_is_never_written_through_a_planted_symlink(hub, tmp_path):
    hub.add_repo("Qwen/Qwen-Image-2.1-PE-T2I", {mf.PROMPT_FILE: b"You enhance prompts.\n"})
    models = tmp_path / "models"
    path = Path(mf.prompt_path("text-to-image", str(models)))
    links = _plant(tmp_path, path.parent, [path.name + ".part"] + [f"{path.name}.{os.getpid()}.{n}.part"
                                                                   for n in range(2)])
    assert mf.official_system_prompt("text-to-image", str(models)) == "You enhance prompts."
    assert not list(tmp_path.glob("outside*")) and all(link.is_symlink() for link in links)
    assert path.read_bytes() == b"You enhance prompts.\n" and not path.is_symlink()


_LOCK_SCRIPT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from _standalone import load_pack
load_pack()
from qwen35_fast.downloads import file_lock
file_lock.TICK = 0.0005
dest, marker, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4])
clashes = 0
for _ in range(rounds):
    with file_lock.locked(dest):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            clashes += 1
            continue
        time.sleep(0.0005)
        os.remove(marker)
print(clashes)
"""


def _hold_in_turn(dest: str, marker: str, rounds: int, clashes: list) -> None:
    for _ in range(rounds):
        with file_lock.locked(dest):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                clashes.append(1)
                continue
            time.sleep(0.0005)
            os.remove(marker)


def test_the_lock_keeps_one_writer_while_its_file_is_removed(tmp_path, monkeypatch):
    """Writers in threads and processes take turns on one lock whose holder removes its file before
    letting go: never two inside at once (a marker created exclusively inside), no file left after."""
    monkeypatch.setattr(file_lock, "TICK", 0.0005)
    dest, marker = str(tmp_path / "model.safetensors"), str(tmp_path / "inside")
    procs = [subprocess.Popen([sys.executable, "-c", _LOCK_SCRIPT, str(ROOT), dest, marker, "300"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    clashes: list = []
    threads = [threading.Thread(target=_hold_in_turn, args=(dest, marker, 300, clashes)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    runs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in runs]
    assert clashes == [] and [int(out) for out, _ in runs] == [0, 0]
    assert os.listdir(tmp_path) == []


def test_a_ledger_never_vouches_for_bytes_it_did_not_see(tmp_path):
    """``Ledger.resume`` keeps exactly the runs whose bytes match, and its digest is theirs."""
    part = str(tmp_path / "f.part")
    ledger = part_file.Ledger(part, base=4)
    ledger.start(b"HEAD")
    runs = [os.urandom(1000), os.urandom(777), os.urandom(50)]
    with open(part, "ab") as f:
        for r in runs:
            f.write(r)
            ledger.add(r)
            ledger.seal()
        f.write(b"unsealed tail")
    with open(part, "r+b") as f:
        f.seek(4 + 1000 + 777 + 3)  # a byte of the third run
        f.write(b"\x00" if runs[2][3] else b"\x01")
    again = part_file.Ledger(part, base=4)
    assert again.resume() == 1000 + 777
    assert again.sha256() == hashlib.sha256(runs[0] + runs[1]).hexdigest()
    assert Path(part).read_bytes() == b"HEAD" + runs[0] + runs[1]
    assert len(Path(part + ".sums").read_bytes().splitlines()) == 2


def test_source_unchecked_tells_heads_read_by_ranges_from_extracted_ones(hub, repo, tmp_path):
    files, sd = repo
    path = Path(mf.fetch_mtp_head("9B", str(tmp_path / "te")))
    assert head_check.source_unchecked(str(path)) == head_check.RANGES_CHECKED

    def older(header, data):  # a head the pack fetched before data_checked was written
        header["__metadata__"].pop("data_checked")
        return data

    safety._rewrite(path, older)
    assert head_check.source_unchecked(str(path)) == head_check.RANGES_CHECKED
    out = fetch_tests.extract_head(files, tmp_path)
    assert head_check.source_unchecked(str(out)) is None  # from complete files `hf download` checked
