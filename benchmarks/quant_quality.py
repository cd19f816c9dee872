"""What 8-bit and 4-bit weights cost in next-token distributions, on a random Qwen3.5 (numerics only).

For a random model (``decode_e2e.build_model(decisive=False)``: every projection random at the same
scale, so every weight matters) the script builds the weights each file would hold, quantized by
comfy-kitchen as ComfyUI's formats quantize them, and measures against the bf16 model:

* per layer: the relative weight error ``|W' - W| / |W|`` and the relative output error of one
  product ``|x W'^T - x W^T| / |x W^T|`` (random x, float64), medians and maxima per format;
* teacher-forced over ``--tokens`` random tokens (one prefill, every position's logits): the mean
  KL divergence ``KL(p_bf16 || p_q)`` of the next-token distributions and the top-1 agreement.

Variants: ``int8`` (int8_tensorwise + ConvRot 256, the official file's format), ``w4a4`` /
``nvfp4`` from the bf16 weights, and ``w4a4<-int8`` / ``nvfp4<-int8`` from the int8 file's weights
(what ``patches/convert_4bit.py`` makes of the official file). Weights are chosen as the converter
chooses (decoder-layer projections; ``lm_head`` and the embedding stay as the source holds them).
Every product is weight-only here (ComfyUI's own convrot_w4a4 prefill would also quantize the
activations). Random weights have no knowledge to lose: these numbers bound the numerics, not the
answers; compare answers on real prompts.

    python benchmarks/quant_quality.py --size 9b --tokens 1000 --json quant_quality.json   (a GPU)
    python benchmarks/quant_quality.py --size tiny --tokens 16                            (CPU check)
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.engine import Qwen35Config, bind  # noqa: E402
from qwen35_fast.engine.cache import ModelCache  # noqa: E402
from qwen35_fast.engine.forward import Runner  # noqa: E402

from benchmarks.decode_e2e import build_model, config_9b  # noqa: E402

log = logging.getLogger("quant_quality")
LAYER = re.compile(r"^layers\.\d+\.(self_attn|linear_attn|mlp)\.[a-z_]+\.weight$")
VARIANTS = ("int8", "w4a4", "nvfp4", "w4a4<-int8", "nvfp4<-int8")


def config_tiny() -> Qwen35Config:
    """A 256-wide model (ConvRot 256 applies) for the CPU check."""
    layers = 4
    return Qwen35Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=128, linear_value_head_dim=128, conv_kernel_size=4,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        lm_head=True, mtp_num_hidden_layers=1)


def quantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` as ComfyUI dequantizes it after comfy-kitchen quantized it to ``fmt`` (float32)."""
    from comfy_kitchen.tensor import QuantizedTensor

    w = w.float()
    if fmt == "int8":
        qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True,
                                        convrot_groupsize=256)
    elif fmt == "w4a4":  # the converter's clipped rows, kitchen's quantizer
        from qwen35_fast.patches.quant_values import w4a4_input

        qt = QuantizedTensor.from_float(w4a4_input(w), "TensorCoreConvRotW4A4Layout", convrot_groupsize=256)
    else:
        from qwen35_fast.patches.quant_values import nvfp4_input

        qt = QuantizedTensor.from_float(nvfp4_input(w), "TensorCoreNVFP4Layout")
    return qt.dequantize().float()


def takes(name: str, w: torch.Tensor, fmt: str) -> bool:
    """Whether the converter (or the int8 file) quantizes this weight to ``fmt``."""
    if fmt == "int8":
        return w.dim() == 2 and w.shape[1] % 256 == 0 and (bool(LAYER.match(name)) or name == "lm_head.weight")
    return bool(LAYER.match(name)) and w.dim() == 2 and (fmt == "nvfp4" or w.shape[1] % 256 == 0)


@torch.no_grad()
def logits_of(gen, ids: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """float32 ``[T, V]``: every position's next-token logits, one prefill."""
    b = bind(gen)
    cache = ModelCache(b.config, batch=1, capacity=ids.shape[1] + 8, dtype=dtype, device=device, mtp=False)
    runner = Runner(b, cache, dtype=dtype, device=device, attention="torch")
    t = ids.shape[1]
    hidden, _ = runner.forward(b.embed(ids, dtype, device), torch.arange(t, device=device).expand(3, t),
                               keep_rows=False)
    return b.logits(hidden)[0].float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agree": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def run(cfg: Qwen35Config, tokens: int, device, seed: int = 0, variants=VARIANTS) -> dict:
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    gen = build_model(cfg, device, dtype, seed=seed, decisive=False)
    params = dict(gen.model.named_parameters())
    names = [n for n, p in params.items() if p.dim() == 2 and not n.startswith("mtp.")]
    original = {n: params[n].detach().to("cpu", copy=True) for n in names}  # bf16 on the host: one copy
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed + 1))
    ref = logits_of(gen, ids, dtype, device)
    out = {"tokens": tokens, "dtype": str(dtype), "variants": {}}
    gx = torch.Generator(device="cpu").manual_seed(seed + 2)
    for variant in variants:
        fmt, _, source = variant.partition("<-")
        w_err, y_err = [], []
        for n in names:
            w = original[n].to(device).float()
            if source and takes(n, w, source):
                w = quantized(w, source)  # the int8 file's weight is the converter's source
            if takes(n, w, fmt):
                q = quantized(w, fmt)
                w0 = original[n].to(device).double()
                w_err.append(((q.double() - w0).norm() / w0.norm()).item())
                x = torch.randn(4, w.shape[1], generator=gx).to(device).double()
                y0 = x @ w0.T
                y_err.append(((x @ q.double().T - y0).norm() / y0.norm()).item())
                w = q
            params[n].data.copy_(w.to(dtype))
        row = compare(ref, logits_of(gen, ids, dtype, device))
        row.update(layers=len(w_err), weight_err_median=statistics.median(w_err), weight_err_max=max(w_err),
                   product_err_median=statistics.median(y_err), product_err_max=max(y_err))
        out["variants"][variant] = row
        log.info("%-12s KL %.4g (max %.3g)  top-1 %.4f  weight err %.4f (max %.4f)  product err %.4f", variant,
                 row["kl_mean"], row["kl_max"], row["top1_agree"], row["weight_err_median"], row["weight_err_max"],
                 row["product_err_median"])
        for n in names:
            params[n].data.copy_(original[n].to(device))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["9b", "tiny"], default="9b")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run(config_9b() if args.size == "9b" else config_tiny(), args.tokens, device, args.seed, args.variants)
    result.update(size=args.size, device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
