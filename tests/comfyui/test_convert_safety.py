"""One writer per converted file, and nothing but what was meant (``patches/convert_4bit.py``): two
conversions of one file at once (threads, processes) publish one file equal byte for byte to a
single conversion's; planted symbolic links at the part and lock paths are never followed; a part
file written over during the conversion is caught before it is published; NaN / inf weights are
refused naming every such tensor; every bad input is a ConversionError naming the fix (never
"delete the source"); no lock or part file stays after success, failure or Cancel.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from qwen35_fast.patches import convert_4bit
from qwen35_fast.patches.convert_4bit import ConversionError

from tests.comfyui.test_convert_4bit import source_file

pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt) quantizes")

ROOT = Path(__file__).resolve().parents[2]
FMT = "nvfp4"
OUT = "tiny.nvfp4.safetensors"


def reference(src: Path, tmp_path: Path) -> bytes:
    """The bytes of a single conversion of ``src``, alone in a folder of its own."""
    folder = tmp_path / "reference"
    folder.mkdir(exist_ok=True)
    return convert_4bit.convert(src, folder, FMT, device="cpu").read_bytes()


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def edit_tensors(src: Path, dest: Path, edit) -> Path:
    """A copy of the safetensors file ``src`` at ``dest`` with ``edit(tensors)`` applied (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    edit(tensors)
    save_file(tensors, str(dest), metadata=meta)
    return dest


def test_two_threads_converting_one_file_publish_one_conversion(tmp_path):
    src = source_file(tmp_path, "bf16")
    ref = reference(src, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    first_in, second_waits = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first():
        def progress(done, total, key):
            first_in.set()
            if done == 1:
                second_waits.wait(30)  # hold on until the second conversion is under way
        try:
            results["first"] = convert_4bit.convert(src, out, FMT, device="cpu", progress=progress)
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            results["first"] = exc

    def second():
        first_in.wait(30)

        def cancelled():  # called while it waits for the other conversion (and per tensor once running)
            second_waits.set()
            return False
        try:
            results["second"] = convert_4bit.convert(src, out, FMT, device="cpu", cancelled=cancelled)
        except Exception as exc:  # noqa: BLE001
            results["second"] = exc

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["first"] == out / OUT, results
    assert isinstance(results["second"], ConversionError), results
    assert "written by another conversion while this one waited" in str(results["second"])
    assert (out / OUT).read_bytes() == ref
    assert listing(out) == [OUT]  # no part or lock file


_CONVERT_SCRIPT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from _standalone import load_pack
load_pack()
from qwen35_fast.patches import convert_4bit
src, out, ready, go = sys.argv[2:6]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
try:
    print(convert_4bit.convert(src, out, "nvfp4", device="cpu", progress=lambda d, t, k: time.sleep(0.05)))
except convert_4bit.ConversionError as exc:
    print("ConversionError:", exc)
    sys.exit(3)
"""


def test_two_processes_converting_one_file_publish_one_conversion(tmp_path):
    src = source_file(tmp_path, "bf16")
    ref = reference(src, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT_SCRIPT, str(ROOT), str(src), str(out), str(r), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both start converting at once (the conversion itself takes seconds: progress sleeps)
    runs = [p.communicate(timeout=180) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 3], [err[-2000:] for _, err in runs]
    lost = next(o for p, (o, _) in zip(procs, runs) if p.returncode == 3)
    assert "written by another conversion while this one waited" in lost
    assert (out / OUT).read_bytes() == ref
    assert listing(out) == [OUT]


def test_planted_symlinks_at_the_part_and_lock_paths_are_never_followed(tmp_path):
    src = source_file(tmp_path, "bf16")
    ref = reference(src, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    dst = out / OUT
    planted = [Path(f"{dst}.part")] + [Path(f"{dst}.{os.getpid()}.{n}.part") for n in range(3)]
    for i, link in enumerate(planted):  # to a file of the user's, or dangling (writing would create it)
        link.symlink_to(victim if i % 2 else tmp_path / f"absent{i}")
    stale = Path(f"{dst}.999999.0.part")  # a plain part file a killed conversion left
    stale.write_bytes(b"stale")
    assert convert_4bit.convert(src, out, FMT, device="cpu").read_bytes() == ref
    assert victim.read_bytes() == b"keep me" and not list(tmp_path.glob("absent*"))
    assert all(link.is_symlink() for link in planted) and not stale.exists()
    assert sorted(set(listing(out)) - {p.name for p in planted}) == [OUT]

    dst.unlink()
    Path(f"{dst}.lock").symlink_to(tmp_path / "absent_lock")
    with pytest.raises(ConversionError, match="lock.*symbolic link|symbolic link"):
        convert_4bit.convert(src, out, FMT, device="cpu")
    assert not (tmp_path / "absent_lock").exists() and not dst.exists()


def _flip_in_tensor(part: Path) -> None:
    raw = bytearray(part.read_bytes())
    at = 8 + struct.unpack("<Q", bytes(raw[:8]))[0]  # the first tensor's first byte
    raw[at] ^= 0xFF
    with open(part, "r+b") as f:
        f.write(bytes(raw[:at + 1]))


def _flip_in_header(part: Path) -> None:
    with open(part, "r+b") as f:
        f.seek(9)
        c = f.read(1)
        f.seek(9)
        f.write(b"_" if c != b"_" else b"-")


@pytest.mark.parametrize("scribble, match", [(_flip_in_tensor, "the bytes of .* differ from those written"),
                                             (_flip_in_header, "its header differs")])
def test_a_part_file_written_over_is_caught_before_it_is_published(tmp_path, scribble, match):
    """Another program writing into the part file mid-conversion: the written file is compared with
    what was meant to be written (header bytes, each tensor's sha256) and never published."""
    src = source_file(tmp_path, "bf16")
    out = tmp_path / "out"
    out.mkdir()

    def progress(done, total, key):
        if done == total - 1:
            (part,) = [p for p in out.iterdir() if p.name.endswith(".part")]
            scribble(part)

    with pytest.raises(ConversionError, match=match) as err:
        convert_4bit.convert(src, out, FMT, device="cpu", progress=progress)
    assert "nothing was published" in str(err.value)
    assert listing(out) == []


def _nan_projection(t):
    t["model.language_model.layers.0.mlp.gate_proj.weight"][3, 5] = float("nan")


def _inf_embedding(t):
    t[convert_4bit.EMBEDDING][7, 1] = float("inf")


def _inf_norm(t):
    t["model.language_model.norm.weight"][0] = -float("inf")


def _nan_int8_scale(t):
    t["model.language_model.layers.1.mlp.up_proj.weight_scale"][2] = float("nan")


def _several(t):
    _nan_projection(t)
    t["lm_head.weight"][0, 0] = float("inf")
    t["model.language_model.layers.2.linear_attn.A_log"][1] = float("nan")


@pytest.mark.parametrize("kind, edit, named", [
    ("bf16", _nan_projection, ["model.language_model.layers.0.mlp.gate_proj.weight"]),
    ("bf16", _inf_embedding, [convert_4bit.EMBEDDING]),
    ("bf16", _inf_norm, ["model.language_model.norm.weight"]),
    ("int8_convrot", _nan_int8_scale, ["model.language_model.layers.1.mlp.up_proj.weight_scale"]),
    ("bf16", _several, ["model.language_model.layers.0.mlp.gate_proj.weight", "lm_head.weight",
                        "model.language_model.layers.2.linear_attn.A_log"]),
])
def test_nan_or_inf_weights_are_refused_naming_every_tensor(tmp_path, kind, edit, named):
    src = edit_tensors(source_file(tmp_path, kind), tmp_path / f"bad.{kind}.safetensors", edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(convert_4bit.NonFinite) as err:
        convert_4bit.convert(src, out, FMT, device="cpu")
    assert sorted(err.value.names) == sorted(named)
    assert all(name in str(err.value) for name in named) and "nothing was written" in str(err.value)
    assert listing(out) == []


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _header_swapped(src: Path, header: dict) -> bytes:
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def _header(src: Path) -> dict:
    raw = src.read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


def _bad_dtype(src, tmp):
    h = _header(src)
    h["lm_head.weight"]["dtype"] = "Q9"
    return _write(tmp / "dtype.bf16.safetensors", _header_swapped(src, h)), tmp / "out", FMT, {}


def _garbled_comfy_quant(src, tmp):
    def edit(t):
        t["model.language_model.layers.0.mlp.up_proj.comfy_quant"] = torch.tensor(list(b"{not json"),
                                                                                    dtype=torch.uint8)
    return edit_tensors(src, tmp / "cq.int8_convrot.safetensors", edit), tmp / "out", FMT, {}


def _no_scale(src, tmp):
    def edit(t):
        del t["model.language_model.layers.0.mlp.up_proj.weight_scale"]
    return edit_tensors(src, tmp / "noscale.int8_convrot.safetensors", edit), tmp / "out", FMT, {}


def _quant_meta(src, tmp):
    from safetensors.torch import load_file, save_file

    path = tmp / "meta.bf16.safetensors"
    save_file(load_file(str(src)), str(path), metadata={"_quantization_metadata": "{oops"})
    return path, tmp / "out", FMT, {}


def _other_model(src, tmp):
    from safetensors.torch import save_file

    path = tmp / "t5xxl.bf16.safetensors"
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(8, 8)}, str(path))
    return path, tmp / "out", FMT, {}


def _same_file(src, tmp):
    first = convert_4bit.convert(src, tmp / "out", FMT, device="cpu")
    return first, tmp / "out", FMT, {}


def _already_other_format(src, tmp):
    first = convert_4bit.convert(src, tmp / "out", FMT, device="cpu")
    return first, tmp / "out", "convrot_w4a4", {}


def _unwritable(src, tmp):
    folder = tmp / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    probe = folder / "probe"
    try:
        probe.write_bytes(b"")  # root writes anyway: use a folder of the kernel's where nobody can create files
        probe.unlink()
        folder = Path("/sys")
        if not folder.is_dir() or os.access(folder / OUT, os.F_OK):
            pytest.skip("no folder here refuses new files to this user")
    except PermissionError:
        pass
    return src, folder, FMT, {}


BAD_INPUTS = {
    "missing source": (lambda s, t: (t / "absent.safetensors", t / "out", FMT, {}), "does not exist"),
    "a folder as source": (lambda s, t: (t / "out", t / "out", FMT, {}), "is not a file"),
    "empty file": (lambda s, t: (_write(t / "e.safetensors", b""), t / "out", FMT, {}), "empty or truncated"),
    "a pickle checkpoint": (lambda s, t: (_write(t / "m.ckpt", b"PK\x03\x04" + bytes(200)), t / "out", FMT, {}),
                            "not a safetensors file"),
    "a GGUF file": (lambda s, t: (_write(t / "m.gguf", b"GGUF\x03\x00\x00\x00" + bytes(64)), t / "out", FMT, {}),
                    "not a safetensors file"),
    "a text file": (lambda s, t: (_write(t / "m.safetensors", b"hello, not a model\n" * 8), t / "out", FMT, {}),
                    "not a safetensors file"),
    "truncated": (lambda s, t: (_write(t / "cut.bf16.safetensors", s.read_bytes()[:-100]), t / "out", FMT, {}),
                  "truncated"),
    "garbled header": (lambda s, t: (_write(t / "g.bf16.safetensors", s.read_bytes()[:8] + b"\xff" * 24 +
                                            s.read_bytes()[32:]), t / "out", FMT, {}), "corrupt"),
    "unknown dtype in the header": (_bad_dtype, "unknown dtype 'Q9'"),
    "not Qwen3.5": (_other_model, "is not a Qwen3.5 text encoder"),
    "garbled comfy_quant": (_garbled_comfy_quant, "up_proj.comfy_quant is not a comfy_quant JSON entry"),
    "int8 layer without its scale": (_no_scale, "up_proj has no .*up_proj.weight_scale"),
    "garbled quantization metadata": (_quant_meta, "_quantization_metadata is not JSON"),
    "output is the source": (_same_file, "already a nvfp4 file: its nvfp4 copy would be the file itself"),
    "source already 4-bit": (_already_other_format, "already nvfp4.*nothing to convert"),
    "missing output folder": (lambda s, t: (s, t / "absent", FMT, {}), "does not exist or is not a folder"),
    "output folder is a file": (lambda s, t: (s, _write(t / "file", b"x"), FMT, {}),
                                "does not exist or is not a folder"),
    "unwritable output folder": (_unwritable, "Cannot create"),
    "unknown format": (lambda s, t: (s, t / "out", "int3", {}), "one of convrot_w4a4, nvfp4"),
    "unknown device": (lambda s, t: (s, t / "out", FMT, {"device": "tpu9"}), "'tpu9' is not a device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_every_bad_input_gets_a_named_error(tmp_path, case):
    make, match = BAD_INPUTS[case]
    kind = "int8_convrot" if case in ("garbled comfy_quant", "int8 layer without its scale") else "bf16"
    src = source_file(tmp_path, kind)
    (tmp_path / "out").mkdir()
    source, out_dir, fmt, kwargs = make(src, tmp_path)
    before = source.read_bytes() if source.is_file() else None
    listed = listing(out_dir) if out_dir.is_dir() else None
    with pytest.raises(ConversionError, match=match) as err:
        convert_4bit.convert(source, out_dir, fmt, **{"device": "cpu", **kwargs})
    assert "delete" not in str(err.value).lower()  # never advice to delete the source
    if before is not None:
        assert source.read_bytes() == before
    if listed is not None:
        assert listing(out_dir) == listed  # nothing written, no part or lock file


@pytest.mark.parametrize("outcome", ["success", "failure", "cancel"])
def test_no_lock_or_part_file_stays_after_a_conversion(tmp_path, outcome):
    src = source_file(tmp_path, "bf16")
    if outcome == "failure":
        src = edit_tensors(src, tmp_path / "nan.bf16.safetensors", _inf_norm)
    out = tmp_path / "out"
    out.mkdir()
    seen = []

    def cancelled():
        if outcome == "cancel" and any(p.name.endswith(".lock") for p in out.iterdir()):
            seen.append(listing(out))  # the lock file exists while the conversion runs
            return len(seen) > 3
        return False

    expected = {"success": None, "failure": convert_4bit.NonFinite, "cancel": convert_4bit.ConversionCancelled}
    if expected[outcome] is None:
        convert_4bit.convert(src, out, FMT, device="cpu", cancelled=cancelled)
    else:
        with pytest.raises(expected[outcome]):
            convert_4bit.convert(src, out, FMT, device="cpu", cancelled=cancelled)
    assert listing(out) == ([OUT] if outcome == "success" else [])
    if outcome == "cancel":
        assert any(n.endswith(".lock") for n in seen[0]) and any(n.endswith(".part") for n in seen[0])


def test_the_tool_reports_a_bad_input_in_one_line(tmp_path):
    """``tools/quantize_4bit.py`` on a file that is no safetensors file: status 2, the named error, no traceback."""
    bad = _write(tmp_path / "model.safetensors", b"hello, not a model\n" * 8)
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "quantize_4bit.py"), str(bad), "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "is not a safetensors file" in run.stderr and "Traceback" not in run.stderr
    assert listing(tmp_path) == ["model.safetensors"]
