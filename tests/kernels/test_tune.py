"""``benchmarks/tune.py``'s table making (the GPU sweep itself runs only on a GPU): the written table
holds every swept launch at its current pick, a challenger replaces it only when it wins by the
margin, and the pack reads the result (``launch.read_table``)."""

import json

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
