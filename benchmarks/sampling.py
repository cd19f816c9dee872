"""GPU time of one sampled draw at Qwen3.5's vocabulary (248320 logits), piece by piece.

Times (the torch profiler's kernel durations per call): ``Sampler.draw_async`` with the prompt enhancer's
text-to-image settings (top-k 20, top-p 0.95, presence penalty 1.5) and its parts: the penalties,
``torch.topk``, the filtered softmax and the draw (noise keyed by seed and position); greedy's argmax;
and an MTP point-mass draft's token (the mode of the same distribution) through ``target_probs`` and
through ``target_argmax``.
The decode loop pays the draw once per token on top of the model step.

Usage: python benchmarks/sampling.py [--vocab 248320] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.engine.distribution import (  # noqa: E402
    _filtered_softmax,
    _penalised_tempered,
    target_argmax,
    target_probs,
)
from qwen35_fast.engine.draw import keyed_draw  # noqa: E402
from qwen35_fast.engine.sampling import Sampler  # noqa: E402
from qwen35_fast.engine.sampling_params import SamplingParams  # noqa: E402


def kernel_us(fn, reps: int = 20) -> tuple[float, float]:
    """(GPU kernel microseconds per call of ``fn``, kernel launches per call): the torch profiler's
    kernel durations over ``reps`` calls after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time for e in kernels) / reps, len(kernels) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--json", default="sampling.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5)
    sampler = Sampler(params, seed=0, first_position=2000, stop_tokens=[], min_tokens=0,
                      initial_tokens=list(range(0, 4000, 7)), device=dev, mtp_draft="argmax")
    logits = torch.randn(1, args.vocab, device=dev) * 4
    seen = sampler.seen_rows(None, 1, args.vocab)
    x = _penalised_tempered(logits, seen, params)
    values, ids = torch.topk(x, 20)
    probs = _filtered_softmax(values, params)
    rows = {
        "draw_async (text-to-image settings)": lambda: sampler.draw_async(logits, 0),
        "penalties": lambda: _penalised_tempered(logits, seen, params),
        "topk 20": lambda: torch.topk(x, 20),
        "filtered softmax (top-p) of 20": lambda: _filtered_softmax(values, params),
        "draw of 20 (keyed_draw)": lambda: keyed_draw(probs, ids, 12345),
        "greedy argmax": lambda: logits[0].argmax(),
        "point-mass draft before (target_probs, then argmax)": lambda: target_probs(logits, seen, params)[0].argmax(),
        "point-mass draft (target_argmax)": lambda: target_argmax(logits, seen, params),
    }
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vocab": args.vocab, "us": {}}
    for name, fn in rows.items():
        us, launches = kernel_us(fn)
        out["us"][name] = {"us": us, "launches": launches}
        print(f"{us:9.1f} us  {launches:5.1f} launches  {name}", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
