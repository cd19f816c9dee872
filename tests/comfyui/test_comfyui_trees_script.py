"""Where ``scripts/comfyui_trees.sh`` takes the real-ComfyUI tests' tree from, run as a user's fresh clone
would run it (only its tree-resolution and tree-building parts: ``--resolve``, ``--trees``; no venv is
built), and ``scripts/qwen35_vocab.py``, which rebuilds a tree's missing tokenizer vocabulary.

The README's test command must pass on a clone of the repo alone: with no shared folder, no tree named
and the git way off, ``scripts/test_comfyui.sh`` prints one ``skip:`` line and exits 0; with
``QWEN35_FAST_REQUIRE_COMFYUI=1`` (CI) it fails. The git way is exercised against a local repository
tagged as upstream's pinned tag. The vocabulary oracle is upstream ComfyUI's own
``qwen35_tokenizer/vocab.json`` (entries quoted below) and the byte-level BPE rule that every merge of
``merges.txt`` resolves to an entry.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ROOT / "scripts" / "comfyui_trees.sh"
STAGE = ROOT / "scripts" / "test_comfyui.sh"
VOCAB = "comfy/text_encoders/qwen35_tokenizer/vocab.json"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")

# (token bytes, its text and rank in upstream ComfyUI's qwen35_tokenizer/vocab.json)
UPSTREAM = [(b"!", "!", 0), (b"\xa1", "\u00a1", 94), (b"\x00", "\u0100", 188), (b"\x20", "\u0120", 220),
            (b"\n", "\u010a", 198), (b"  ", "\u0120\u0120", 256), (b"in", "in", 258), (b" t", "\u0120t", 259),
            (b"\n\n", "\u010a\u010a", 271), (b" the", "\u0120the", 279), (b"\xc3\xa9", "\u00c3\u00a9", 933),
            (b"t", "t", 83), (b"h", "h", 71), (b"e", "e", 68), (b" th", "\u0120th", 270), (b"i", "i", 72),
            (b"n", "n", 77), (b"\xc3", "\u00c3", 127), (b"\xa9", "\u00a9", 102)]
MERGES = ["#version: 0.2", "\u0120 t", "i n", "\u0120t h", "\u0120th e", "\u010a \u010a", "\u0120 \u0120",
          "\u00c3 \u00a9"]


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("QWEN35_FAST_") and k not in ("XDG_CACHE_HOME", "PIP_CACHE_DIR")}
    empty = tmp_path / "no_shared"
    empty.mkdir(exist_ok=True)
    env.update({"QWEN35_FAST_SHARED": str(empty), "QWEN35_FAST_CI_CACHE": str(tmp_path / "cache"), **extra})
    return env


def _run(args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _table(path: Path) -> Path:
    path.write_text("".join(f"{base64.b64encode(b).decode()} {rank}\n" for b, _, rank in UPSTREAM))
    return path


def _upstream_like_repo(tmp_path: Path, *, vocab: bool) -> Path:
    """A git repository tagged v0.29.0 holding a ComfyUI-shaped tree (with or without vocab.json)."""
    repo = tmp_path / "upstream"
    tok = repo / Path(VOCAB).parent
    tok.mkdir(parents=True)
    (repo / "main.py").write_text("# ComfyUI\n")
    (tok / "merges.txt").write_text("\n".join(MERGES) + "\n")
    if vocab:
        (tok / "vocab.json").write_text(json.dumps({text: rank for _, text, rank in UPSTREAM}))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tree"], check=True)
    subprocess.run([*git, "tag", "v0.29.0"], check=True)
    (repo / "main.py").write_text("# after the tag\n")  # the clone must be the tag, not the branch head
    subprocess.run([*git, "commit", "-q", "-am", "later"], check=True)
    return repo


def test_a_clone_alone_skips_the_comfyui_stage_in_one_line_and_exits_0(tmp_path):
    res = _run([STAGE], _env(tmp_path, QWEN35_FAST_COMFYUI_GIT="0"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("skip:"), res.stdout
    assert "QWEN35_FAST_COMFYUI_TREE=" in lines[0] and "QWEN35_FAST_COMFYUI_GIT=0" in lines[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing built


def test_ci_requires_the_stage(tmp_path):
    res = _run([STAGE], _env(tmp_path, QWEN35_FAST_COMFYUI_GIT="0", QWEN35_FAST_REQUIRE_COMFYUI="1"))
    assert res.returncode != 0
    assert res.stderr.startswith("skip:") and "QWEN35_FAST_REQUIRE_COMFYUI=1" in res.stderr
    ci = (ROOT / ".ci" / "run").read_text()  # CI runs the README's command with every stage required
    assert "QWEN35_FAST_REQUIRE_COMFYUI=1" in ci and "bash scripts/test.sh" in ci


def test_an_unreachable_git_remote_is_a_skip_too(tmp_path):
    res = _run([TREES, "--resolve"], _env(tmp_path, QWEN35_FAST_COMFYUI_GIT_URL=f"file://{tmp_path}/nothing"))
    assert res.returncode == 0
    assert res.stdout.startswith("skip:") and "cannot be reached" in res.stdout


def test_the_shared_folder_wins(tmp_path):
    shared = tmp_path / "shared"
    (shared / "comfyui").mkdir(parents=True)
    (shared / "comfyui" / "comfyui-0.29.0.tar.xz").write_bytes(b"")
    folder = tmp_path / "mine"
    (folder / "comfy").mkdir(parents=True)
    (folder / "main.py").write_text("")
    res = _run([TREES, "--resolve"], _env(tmp_path, QWEN35_FAST_SHARED=str(shared),
                                         QWEN35_FAST_COMFYUI_TREE=str(folder)))
    assert res.stdout.split() == ["source", "shared", str(shared.resolve())], res.stderr


def test_a_named_folder_is_used_and_a_wrong_one_refused(tmp_path):
    folder = tmp_path / "mine"
    (folder / "comfy").mkdir(parents=True)
    (folder / "main.py").write_text("")
    res = _run([TREES, "--resolve"], _env(tmp_path, QWEN35_FAST_COMFYUI_TREE=str(folder)))
    assert res.stdout.split() == ["source", "folder", str(folder.resolve())], res.stderr
    res = _run([TREES, "--trees"], _env(tmp_path, QWEN35_FAST_COMFYUI_TREE=str(folder)))
    assert res.stdout.split() == ["tree", "custom", str(folder.resolve()), "-"], res.stderr
    res = _run([TREES, "--resolve"], _env(tmp_path, QWEN35_FAST_COMFYUI_TREE=str(tmp_path)))
    assert res.returncode == 2 and not res.stdout
    assert "not a ComfyUI folder" in res.stderr and "main.py" in res.stderr


def test_the_git_way_clones_the_pinned_tag(tmp_path):
    repo = _upstream_like_repo(tmp_path, vocab=True)
    env = _env(tmp_path, QWEN35_FAST_COMFYUI_GIT_URL=f"file://{repo}")
    res = _run([TREES, "--resolve"], env)
    assert res.stdout.split() == ["source", "git", f"file://{repo}", "v0.29.0"], res.stderr
    res = _run([TREES, "--trees"], env)
    assert res.returncode == 0, res.stderr
    kind, label, tree, extra = res.stdout.split()
    assert (kind, label, extra) == ("tree", "0.29.0", "-")
    assert (Path(tree) / "main.py").read_text() == "# ComfyUI\n"  # the tag's file, not the later commit's
    assert (Path(tree) / VOCAB).read_bytes() == (repo / VOCAB).read_bytes()


def test_the_git_way_rebuilds_a_missing_vocabulary(tmp_path):
    repo = _upstream_like_repo(tmp_path, vocab=False)
    env = _env(tmp_path, QWEN35_FAST_COMFYUI_GIT_URL=f"file://{repo}",
               QWEN35_FAST_TOKENIZER_TABLE=str(_table(tmp_path / "qwen3_6.tiktoken")))
    res = _run([TREES, "--trees"], env)
    assert res.returncode == 0, res.stderr
    vocab = json.loads((Path(res.stdout.split()[2]) / VOCAB).read_text())
    assert vocab == {text: rank for _, text, rank in UPSTREAM}


def test_vocab_refuses_a_table_whose_merges_do_not_resolve(tmp_path):
    table = tmp_path / "t.tiktoken"
    table.write_text(f"{base64.b64encode(b'a').decode()} 0\n")
    merges = tmp_path / "merges.txt"
    merges.write_text("\n".join(MERGES) + "\n")
    out = tmp_path / "vocab.json"
    res = subprocess.run(["python3", str(ROOT / "scripts" / "qwen35_vocab.py"), str(table), str(merges), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "do not resolve" in res.stderr
    assert not out.exists()


def test_one_variable_keeps_every_cache_in_one_folder(tmp_path):
    """QWEN35_FAST_CACHE_HOME (relative: inside the clone) moves the caches of pip, Triton, Hugging Face,
    the ComfyUI trees and the test checkpoints there, by each tool's own variable; the git way's clone
    lands there too."""
    home = tmp_path / "caches"
    env = _env(tmp_path, QWEN35_FAST_CACHE_HOME=str(home))
    del env["QWEN35_FAST_CI_CACHE"]
    res = subprocess.run(["bash", "-c", "source scripts/cache_env.sh && env"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    seen = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    for var in ("XDG_CACHE_HOME", "PIP_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "QWEN35_FAST_CI_CACHE",
                "QWEN35_FAST_CACHE"):
        assert seen.get(var, "").startswith(str(home)), (var, seen.get(var))
    repo = _upstream_like_repo(tmp_path, vocab=True)
    res = _run([TREES, "--trees"], {**env, "QWEN35_FAST_COMFYUI_GIT_URL": f"file://{repo}"})
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.split()[2]).is_relative_to(home)
