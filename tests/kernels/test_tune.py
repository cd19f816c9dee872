"""``benchmarks/tune.py``'s table making (the GPU sweep itself runs only on a GPU): the written table
holds every swept launch at its current pick, a challenger replaces it only when it wins by the
margin, and the pack reads the result (``launch.read_table``)."""

import json

import pytest
from qwen35_fast.kernels import launch

from benchmarks import tune


def _row(n, k, quant, rows, split, picked, now, best):
    return {"launch": "x", "n": n, "k": k, "quant": quant, "rows": rows, "split_product": split,
            "picked": [list(picked[0]), picked[1], now], "best": best}


def test_challengers_must_win_by_the_margin_and_the_table_reads_back(tmp_path):
    swept = [
        _row(4096, 4096, True, 1, True, ((32, 256, 2, 4), 4), 10.0,
             [{"config": [64, 256, 4, 3], "split": 2, "us": 9.0}]),
        _row(24576, 4096, True, 4, False, ((64, 256, 4, 4), 1), 30.0, [{"config": [64, 128, 4, 4], "split": 1,
                                                                       "us": 29.9}]),
    ]
    tries = tune.challengers(swept, 0.01)
    assert tries == {"quant 4096x4096 @1": {"config": [64, 256, 4, 3], "split": 2}}  # 0.3% is no win
    entries = tune.table_entries(swept, tries)
    assert entries["gemv"] == {"quant 4096x4096 @1": {"config": [64, 256, 4, 3], "split": 2},
                               "quant 24576x4096 @4": {"config": [64, 256, 4, 4]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"launches": entries}))
    with launch.pinned(path):
        assert launch.gemv(4096, 4096, True, 1, None) == ((64, 256, 4, 3), 2)
        assert launch.gemv(24576, 4096, True, 4, None)[0] == (64, 256, 4, 4)


def test_every_size_lists_the_steps_products():
    for size in tune.SIZES:
        names = [name for name, *_ in tune.launches(size)]
        assert names == ["DeltaNet inputs", "DeltaNet out_proj", "gate/up", "MLP down", "attention q/k/v",
                         "attention o_proj", "lm_head", "MTP fc"]
    assert [n for _, n, *_ in tune.launches("9b")][:1] == [12352]


def test_four_bit_entries_are_their_own_kind_and_fit(tmp_path):
    """A swept 4-bit launch becomes a ``w4a4`` / ``nvfp4`` entry that ``launch.gemv4`` reads, apart
    from the int8 entry of the same shape; the 4-bit grid fits the shared memory it is given."""
    rows = [dict(_row(12352, 4096, True, 1, False, ((32, 256, 4, 3), 1), 60.0,
                      [{"config": [64, 256, 4, 3], "split": 1, "us": 47.0}]), kind=kind)
            for kind in ("w4a4", "nvfp4")]
    tries = tune.challengers(rows, 0.01)
    assert set(tries) == {"w4a4 12352x4096 @1", "nvfp4 12352x4096 @1"}
    path = tmp_path / "t.json"
    taken = {"nvfp4 12352x4096 @1": {"config": [32, 128, 4, 2]}}
    path.write_text(json.dumps({"launches": tune.table_entries(rows, taken)}))
    with launch.pinned(path):
        assert launch.gemv4(12352, 4096, "convrot_w4a4", 1, None)[0] == (32, 256, 4, 3)
        assert launch.gemv4(12352, 4096, "nvfp4", 1, None)[0] == (32, 128, 4, 2)
        assert launch.gemv(12352, 4096, True, 1, None)[0] != (32, 128, 4, 2)  # int8 keeps its own pick
    for shared in (99 * 1024, 227 * 1024):
        grid = tune.candidates4(4096, 4, shared, quick=False)
        assert grid and all(4 * max(1, st - 1) * (bn * bk // 2 + 32 * bk) <= shared and bk <= 512
                            for bn, bk, _, st in grid)
    words = tune.candidates4(4096, 4, 99 * 1024, quick=False, words=True)  # no shared memory: any GPU
    assert words and all(len(c) == 5 and c[2] <= 2 and c[3] == 1 and c[4] in (0, 1) for c in words)
    mma = set(tune.candidates4(4096, 4, 99 * 1024, quick=False, words=True, mma=True)) - set(words)
    assert mma and all(c[0] == 16 and c[1] in (128, 256) and c[4] == 2 for c in mma)  # the register tile's
    assert all(launch.FIELDS["gemv"]["config"][0](list(c)) for c in mma)  # a table may hold each


def test_an_unknown_launch_name_is_refused_naming_the_valid_ones(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["tune.py", "--launches", "gate/up", "DeltaNet input", "--json",
                                     str(tmp_path / "t.json"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as refused:
        tune.main()
    message = str(refused.value.code)
    assert "['DeltaNet input']" in message and "'DeltaNet inputs'" in message and "'gate/up'" in message
    assert not list(tmp_path.iterdir())  # nothing written
