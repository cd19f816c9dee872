"""First-use downloads against a real local HTTP server speaking the Hub's download protocol.

The real ``huggingface_hub`` client talks to it through ``HF_ENDPOINT``; nothing is mocked. Checked:
only the ``mtp.*`` bytes of the base repository are read (served bytes counted), the head loads and
grafts, an interrupted download resumes, corrupt / truncated shards and an offline Hub give clear
errors and leave no file behind, the official system prompt is fetched once and read offline later,
and a Comfy-Org enhancer file downloads with progress.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen35_fast.downloads import hub_client, transfer
from qwen35_fast.downloads import model_fetch as mf
from qwen35_fast.engine import Qwen35Config, generate, load_standalone
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from tests.hub_server import FakeHub
from tests.oracles.tiny import add_mtp, make_tiny, save, to_layout

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[2]
EXTRACT_TOOL = ROOT / "tools" / "extract_mtp_head.py"
MODEL_DIR = "Qwen3.5-9B"  # where extract_head writes the repo's files
REPO = "Qwen/Qwen3.5-9B"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
PROMPTS = {"Qwen/Qwen-Image-2.1-PE-T2I": "You are the official text-to-image prompt enhancer.\n",
           "Qwen/Qwen-Image-2.1-PE-I2I": "You are the official edit prompt enhancer.\n"}


def tiny_repo(seed: int = 5):
    """(files of a sharded Qwen3.5 repo with mtp.* in the second shard, canonical state dict)."""
    sd, d = make_tiny(seed, strength=0.2)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    hf = {k: v.contiguous() for k, v in to_layout(sd, "hf").items()}
    first = {k: v for k, v in hf.items() if k.startswith("model.language_model.layers.")}
    second = {k: v for k, v in hf.items() if k not in first}  # embed, norm, lm_head (stored before mtp.*) and mtp.*
    weight_map = {**{k: SHARDS[0] for k in first}, **{k: SHARDS[1] for k in second}}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf.values())},
             "weight_map": weight_map}
    files = {SHARDS[0]: st_save(first), SHARDS[1]: st_save(second),
             mf.INDEX_FILE: json.dumps(index, indent=2).encode(), "config.json": b"{}"}
    return files, sd


def mtp_bytes(sd) -> int:
    return sum(t.numel() * t.element_size() for k, t in sd.items() if k.startswith("mtp."))


def header_len(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    fake = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(mf, "_license_logged", set())
    yield fake
    fake.stop()


@pytest.fixture
def repo(hub):
    files, sd = tiny_repo()
    hub.add_repo(REPO, files)
    return files, sd


def left_behind(folder) -> list[str]:
    """Every file in ``folder`` (a download's lock file included: none may stay once it ends)."""
    return sorted(os.listdir(folder)) if os.path.exists(folder) else []


def expected_shapes(sd) -> dict:
    return Qwen35Config.from_state_dict(to_layout({k: v for k, v in sd.items() if not k.startswith("mtp.")},
                                                  "hf")).mtp_shapes()


def test_only_mtp_bytes_are_read_and_the_head_grafts(hub, repo, tmp_path, monkeypatch):
    files, sd = repo
    monkeypatch.setattr(transfer, "MIB", 4096)  # "per MiB" progress, scaled to the tiny head
    monkeypatch.setattr(hub_client, "_BLOCK", 4096)  # and reads of that size
    calls = []
    path = mf.fetch_mtp_head("9B", str(tmp_path / "te"), expected_shapes=expected_shapes(sd),
                             progress=lambda done, total: calls.append((done, total)))
    assert os.path.basename(path) == "qwen3.5_9b_mtp_head.safetensors"
    assert not os.path.exists(path + ".part")
    # only the index, the second shard's header and its mtp.* bytes went over the wire
    assert hub.bytes_of(REPO, SHARDS[0]) == 0
    assert hub.bytes_of(REPO, SHARDS[1]) == header_len(files[SHARDS[1]]) + mtp_bytes(sd)
    assert mtp_bytes(sd) < len(files[SHARDS[1]]) - header_len(files[SHARDS[1]])  # the shard has other tensors
    assert hub.bytes_of(REPO) == len(files[mf.INDEX_FILE]) + header_len(files[SHARDS[1]]) + mtp_bytes(sd)
    assert all(auth == "Bearer hf_testtoken" for *_, auth in hub.requests)  # the user's token is sent
    total = mtp_bytes(sd)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) >= total // 4096

    head = load_file(path)
    assert set(head) == {k for k in sd if k.startswith("mtp.")}
    assert all(torch.equal(head[k], sd[k]) for k in head)
    main = save({k: v for k, v in sd.items() if not k.startswith("mtp.")}, tmp_path / "main.safetensors")
    whole = load_standalone(save(sd, tmp_path / "whole.safetensors"))
    grafted = load_standalone(main, mtp_path=path)
    prompt = torch.randn(5, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    a = generate(whole, prompt, do_sample=False, max_length=12, mtp=3)
    b = generate(grafted, prompt, do_sample=False, max_length=12, mtp=3)
    assert a.tokens == b.tokens and b.stats.accepted == a.stats.accepted

    hub.stop()  # reused offline afterwards, verified against the model's shapes again
    assert mf.fetch_mtp_head("9B", str(tmp_path / "te"), expected_shapes=expected_shapes(sd)) == path


def test_interrupted_download_resumes(hub, repo, tmp_path, monkeypatch):
    files, sd = repo
    monkeypatch.setattr(hub_client, "_BLOCK", 4096)
    dest = tmp_path / "te"
    cut = mtp_bytes(sd) // 2
    hub.cut[(REPO, SHARDS[1])] = cut
    with pytest.raises(mf.FetchError, match="broke off.*Run again to resume"):
        mf.fetch_mtp_head("9B", str(dest), retries=0)
    final = dest / "qwen3.5_9b_mtp_head.safetensors"
    assert not final.exists()
    part = dest / "qwen3.5_9b_mtp_head.safetensors.part"
    kept = part.stat().st_size - header_len(part.read_bytes()[:8])
    assert 0 < kept <= cut  # what arrived before the break, in whole read blocks
    before = hub.bytes_of(REPO, SHARDS[1])
    mf.fetch_mtp_head("9B", str(dest))
    # the second run read the shard header again and only the data not yet kept
    assert hub.bytes_of(REPO, SHARDS[1]) - before == header_len(files[SHARDS[1]]) + mtp_bytes(sd) - kept
    assert final.exists() and not part.exists()
    head = load_file(str(final))
    assert all(torch.equal(head[k], sd[k]) for k in head)

    # a broken connection inside one call is resumed there (retries)
    final.unlink()
    hub.cut[(REPO, SHARDS[1])] = cut
    mf.fetch_mtp_head("9B", str(dest))
    assert all(torch.equal(t, sd[k]) for k, t in load_file(str(final)).items())


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "huge header", "index lies"])
def test_corrupt_or_truncated_shard(hub, repo, tmp_path, damage):
    files, sd = repo
    shard = files[SHARDS[1]]
    if damage == "truncated":
        hub.set_file(REPO, SHARDS[1], shard[:-100])
        match = "truncated"
    elif damage == "garbage header":
        hub.set_file(REPO, SHARDS[1], shard[:8] + b"\xff" * 16 + shard[24:])
        match = "corrupt"
    elif damage == "huge header":
        hub.set_file(REPO, SHARDS[1], (len(shard) * 2).to_bytes(8, "little") + shard[8:])
        match = "corrupt or truncated"
    else:
        index = json.loads(files[mf.INDEX_FILE])
        index["weight_map"]["mtp.fc.weight"] = SHARDS[0]
        hub.set_file(REPO, mf.INDEX_FILE, json.dumps(index).encode())
        match = "lacks 'mtp.fc.weight'"
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match=match):
        mf.fetch_mtp_head("9B", str(dest))
    assert left_behind(dest) == []


def test_wrong_size_head_is_refused(hub, repo, tmp_path):
    files, sd = repo
    other, _ = make_tiny(9, hidden_size=32)
    wrong = Qwen35Config.from_state_dict(to_layout(other, "hf")).mtp_shapes()
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match="another Qwen3.5 size"):
        mf.fetch_mtp_head("9B", str(dest), expected_shapes=wrong)
    assert left_behind(dest) == []
    path = mf.fetch_mtp_head("9B", str(dest))  # an existing head is checked before use too
    with pytest.raises(mf.FetchError, match="another Qwen3.5 size.*Delete"):
        mf.fetch_mtp_head("9B", str(dest), expected_shapes=wrong)
    assert os.path.exists(path)


def test_offline_gives_a_clear_error(hub, repo, tmp_path):
    hub.stop()
    dest = tmp_path / "te"
    with pytest.raises(mf.FetchError, match=r"Cannot download the MTP head.*hf download Qwen/Qwen3.5-9B.*"
                                            r"offline, set the loader's mtp_head to 'none'"):
        mf.fetch_mtp_head("9B", str(dest))
    assert left_behind(dest) == []
    with pytest.raises(mf.FetchError, match=r"hf download Qwen/Qwen-Image-2.1-PE-T2I system_prompt.txt.*"
                                            r"offline, write a system prompt of your own"):
        mf.official_system_prompt("text-to-image", str(tmp_path / "models"))
    name = next(iter(mf.PE_FILES))
    with pytest.raises(mf.FetchError, match=r"hf download Comfy-Org/Qwen-Image-2.1 text_encoders/") as err:
        mf.fetch_pe_file(name, str(dest))
    assert "offline" not in str(err.value)  # no way around the model file itself


def test_system_prompt_fetched_once_then_offline(hub, tmp_path, caplog):
    for repo_id, text in PROMPTS.items():
        hub.add_repo(repo_id, {mf.PROMPT_FILE: text.encode()})
    models = str(tmp_path / "models")
    with caplog.at_level(logging.INFO, logger=mf.__name__):
        t2i = mf.official_system_prompt("text-to-image", models)
        edit = mf.official_system_prompt("edit", models)
        gets = [r for r in hub.requests if r[0] == "GET"]
        hub.stop()
        assert mf.official_system_prompt("text-to-image", models) == t2i  # offline now
    assert t2i == PROMPTS["Qwen/Qwen-Image-2.1-PE-T2I"].strip()
    assert edit == PROMPTS["Qwen/Qwen-Image-2.1-PE-I2I"].strip()
    assert len(gets) == 2
    assert os.path.isfile(mf.prompt_path("edit", models))
    license_lines = [r for r in caplog.records if "Qwen Research License" in r.getMessage()]
    assert len(license_lines) == 2  # once per repository, not per use
    with pytest.raises(ValueError, match="no official system prompt for preset 'custom'"):
        mf.official_system_prompt("custom", models)


def test_pe_file_downloads_with_progress(hub, tmp_path):
    name = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"
    data = os.urandom(3 * 1024 * 1024 + 17)
    hub.add_repo(mf.PE_REPO, {f"text_encoders/{name}": data})
    calls = []
    dest = tmp_path / "te"
    path = mf.fetch_pe_file(name, str(dest), progress=lambda d, t: calls.append((d, t)))
    with open(path, "rb") as f:
        assert f.read() == data
    assert left_behind(dest) == [name]  # no part or staging folder is left
    assert calls and calls[-1] == (len(data), len(data))
    hub.stop()
    assert mf.fetch_pe_file(name, str(dest)) == path  # already there: no network
    with pytest.raises(mf.FetchError, match="not a Comfy-Org prompt-enhancer file"):
        mf.fetch_pe_file("other.safetensors", str(dest))


def extract_head(files: dict, tmp_path) -> Path:
    """``tools/extract_mtp_head.py`` run on ``files`` (name -> bytes) written to ``tmp_path / MODEL_DIR``:
    the path of the head it wrote (asserting it succeeded)."""
    folder = tmp_path / MODEL_DIR
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    out = tmp_path / "extracted.safetensors"
    run = subprocess.run([sys.executable, str(EXTRACT_TOOL), str(folder), str(out)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def test_extract_tool_ships_and_matches_the_download(hub, repo, tmp_path):
    files, sd = repo
    ignored = [line.strip().strip("/") for line in (ROOT / ".comfyignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert "tools" not in ignored  # Registry installs keep the tool
    out = extract_head(files, tmp_path)
    fetched = load_file(mf.fetch_mtp_head("9B", str(tmp_path / "te")))
    extracted = load_file(out)
    assert set(fetched) == set(extracted) and all(torch.equal(fetched[k], extracted[k]) for k in fetched)
    placed = tmp_path / "placed"
    placed.mkdir()
    (placed / "qwen3.5_9b_mtp_head.safetensors").write_bytes(out.read_bytes())
    hub.stop()  # an extracted head at the download's place is used as is (its recorded sha256 checks out)
    assert mf.fetch_mtp_head("9B", str(placed), expected_shapes=expected_shapes(sd)).startswith(str(placed))
    bad = subprocess.run([sys.executable, str(EXTRACT_TOOL), str(tmp_path / MODEL_DIR / SHARDS[0]),
                          str(tmp_path / "none.safetensors")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no mtp.* tensors" in bad.stderr
    assert not (tmp_path / "none.safetensors").exists()


def test_loader_download_choice_picks_the_base_repo_of_the_size(hub, repo, tmp_path, monkeypatch):
    files, sd = repo
    assert mf.mtp_download_options()[:2] == [mf.DOWNLOAD_MATCHING, "download (Qwen/Qwen3.5-9B)"]
    assert mf.is_download(mf.DOWNLOAD_MATCHING) and mf.download_repo(mf.DOWNLOAD_MATCHING) is None
    assert mf.download_repo("download (Qwen/Qwen3.5-4B)") == "Qwen/Qwen3.5-4B" and mf.download_repo("x") is None
    main = save({k: v for k, v in sd.items() if not k.startswith("mtp.")}, tmp_path / "main.safetensors")
    with pytest.raises(mf.FetchError, match="not one of the released Qwen3.5 sizes"):
        mf.mtp_head_for("download (Qwen/Qwen3.5-9B)", main, str(tmp_path / "te"))
    monkeypatch.setitem(mf.MTP_BASE_REPOS, "custom", REPO)  # the tiny model stands in for a released size
    with pytest.raises(mf.FetchError, match=r"its MTP head comes from Qwen/Qwen3.5-9B.*download \(Qwen/Qwen3.5-9B\)"):
        mf.mtp_head_for("download (Qwen/Qwen3.5-4B)", main, str(tmp_path / "te"))
    path = mf.mtp_head_for("download (Qwen/Qwen3.5-9B)", main, str(tmp_path / "te"))
    assert set(load_file(path)) == {k for k in sd if k.startswith("mtp.")}
    assert mf.mtp_head_for(mf.DOWNLOAD_MATCHING, main, str(tmp_path / "te")) == path  # the size's own repo
