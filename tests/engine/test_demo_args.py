"""scripts/demo.py's command line: bad values are argparse errors, and --help names the statistic
the verdicts use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("qwen35_demo_script", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("depth", ["0", "9", "-1"])
def test_mtp_depth_out_of_range_is_an_argparse_error(depth, capsys):
    with pytest.raises(SystemExit) as exc:
        _demo().parse_args(["--mtp", depth])
    assert exc.value.code == 2
    assert "--mtp" in capsys.readouterr().err


def test_mtp_depth_in_range_parses():
    demo = _demo()
    assert demo.parse_args(["--mtp", "5"]).mtp == 5
    from qwen35_fast.engine.request import MAX_MTP_DEPTH

    assert demo.MAX_MTP_DEPTH == MAX_MTP_DEPTH


def test_help_names_the_statistic_the_verdict_uses(capsys):
    demo = _demo()
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the best (fastest) counts" in text and "the median counts" not in text
    args = demo.parse_args([])
    results = {(a, m, d): ([1], 1.0, _Stats(), 0.0) for a in ("torch", "masked") for m in args.max_lengths
               for d in ("off", args.mtp)}
    assert "best of" in demo.verdicts(results, args)[0]


class _Stats:
    accepted = drafted = steps = 1
