"""scripts/demo.py's command line: bad values are argparse errors, and --help names the statistic
the verdicts use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("qwen35_demo_script", DEMO)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
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
    results = _results(demo, args, {})
    assert "best of 3" in demo.verdicts(results, args)[0]


class _Stats:
    accepted = drafted = steps = 1


def _results(demo, args, times):
    """Every configuration at 1.0 ms per token in each repeat, except those ``times`` gives."""
    return {(a, m, d): demo.Runs([[1]] * args.repeats, list(times.get((a, m, d), [1.0] * args.repeats)), _Stats())
            for a in ("torch", "masked") for m in args.max_lengths for d in ("off", args.mtp)}


# (large max_length's ms per token, small's, verdict): the ratio's range is fastest large / slowest small
# .. slowest large / fastest small, against the 1.15 limit (worked out by hand)
CASES = [
    ([1.00, 1.02, 1.01], [1.00, 1.01, 1.02], "yes"),                 # x0.98..x1.02: inside 1.15
    ([2.00, 2.10, 2.05], [1.00, 1.02, 1.01], "no"),                  # x1.96..x2.10: beyond it
    ([0.39, 2.00, 1.00], [1.00, 1.10, 1.05], "too noisy to judge"),  # x0.35..x2.00: on both sides
    ([1.20, 1.10, 1.12], [1.00, 1.01, 1.00], "too noisy to judge"),  # x1.09..x1.20: on both sides
]


@pytest.mark.parametrize("large, small, verdict", CASES)
def test_the_flat_verdict_follows_the_tables_numbers_or_says_too_noisy(large, small, verdict):
    demo = _demo()
    args = demo.parse_args([])
    lo, hi = args.max_lengths
    results = _results(demo, args, {("torch", hi, "off"): large, ("torch", lo, "off"): small})
    line = demo.verdicts(results, args)[0]
    assert line.startswith(f"flat in max_length (length-aware attention, MTP off): {verdict} - "), line
    assert f"{min(large):.2f} / {min(small):.2f} ms per token" in line  # the table's best columns
    assert f"x{min(large) / max(small):.2f}..x{max(large) / min(small):.2f}" in line
    assert any(v.startswith("too noisy: ") for v in demo.verdicts(results, args)) == verdict.startswith("too noisy")


@pytest.mark.parametrize("large, small, verdict", CASES)
def test_the_masked_verdict_is_the_same_judgement_the_other_way(large, small, verdict):
    demo = _demo()
    args = demo.parse_args([])
    lo, hi = args.max_lengths
    results = _results(demo, args, {("masked", hi, "off"): large, ("masked", lo, "off"): small})
    line = next(v for v in demo.verdicts(results, args) if v.startswith("capacity-bound"))
    expected = {"yes": "no", "no": "yes"}.get(verdict, verdict)
    assert f"slower at the large max_length: {expected} - " in line, line
