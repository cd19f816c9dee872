"""The torch -> Triton pairs behind the missing-Triton message (``kernels/triton_advice.py``): every
torch the pack supports has one, the command is exact, README's table says the same, and the
message of a failed Triton import carries the command."""

import re
from pathlib import Path

import pytest
from qwen35_fast.kernels import capabilities, triton_advice

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_supported_torch_has_its_triton():
    for minor in range(4, 15):
        assert triton_advice.triton_for(f"2.{minor}.1") is not None, minor
    assert triton_advice.triton_for("2.11.0+cu130") == (3, 6)
    assert triton_advice.triton_for("2.14.1") == (3, 8)
    assert triton_advice.triton_for("2.3.0") is None and triton_advice.triton_for("nightly") is None


def test_the_command_is_exact():
    exe = r"C:\ComfyUI_windows_portable\python_embeded\python.exe"
    assert triton_advice.install_command("2.11.0+cu130", windows=True, python=exe) == \
        exe + ' -m pip install "triton-windows<3.7"'
    spaced = r"C:\Program Files\Python312\python.exe"
    assert triton_advice.install_command("2.6.0", windows=True, python=spaced) == \
        f'"{spaced}" -m pip install "triton-windows<3.3"'
    assert triton_advice.install_command("2.13.0", windows=False, python="python3") == \
        'python3 -m pip install "triton==3.7.*"'
    assert triton_advice.install_command("3.0.0", windows=True) is None
    assert "README lists the pairs" in triton_advice.advice("3.0.0", windows=True)


def test_the_readme_table_matches_the_data():
    rows = re.findall(r"^\| ([\d., ]+) \| (\d+)\.(\d+) \| `\"triton-windows<(\d+)\.(\d+)\"` \|$",
                      README.read_text(), flags=re.M)
    seen = set()
    for torches, major, minor, below_major, below_minor in rows:
        for t in torches.split(","):
            key = tuple(int(v) for v in t.strip().split("."))
            seen.add(key)
            assert triton_advice.TORCH_TRITON[key] == (int(major), int(minor)), t
            assert (int(below_major), int(below_minor)) == (int(major), int(minor) + 1), t
    assert seen == set(triton_advice.TORCH_TRITON), sorted(set(triton_advice.TORCH_TRITON) - seen)


def test_a_failed_triton_import_names_the_command(monkeypatch):
    def no_triton(name, package=None):
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(capabilities.importlib, "import_module", no_triton)
    monkeypatch.setattr(capabilities.sys, "platform", "win32")
    monkeypatch.setattr(capabilities.torch, "__version__", "2.11.0+cu128")
    module, why = capabilities.triton_module.__wrapped__("gemv")
    assert module is None
    assert "No module named 'triton'" in why and 'pip install "triton-windows<3.7"' in why, why
    assert "torch 2.11.0+cu128" in why


@pytest.mark.parametrize("platform, spec", [("linux", '"triton==3.6.*"'), ("win32", '"triton-windows<3.7"')])
def test_the_platform_picks_the_package(monkeypatch, platform, spec):
    monkeypatch.setattr(capabilities.sys, "platform", platform)
    monkeypatch.setattr(capabilities.torch, "__version__", "2.10.0")
    assert spec in capabilities.unusable_reason(ImportError("DLL load failed"))
