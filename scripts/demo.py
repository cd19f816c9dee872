"""Main job on an embedded default (``bash scripts/demo.sh``).

Part 1 builds a small Qwen3.5 checkpoint (random weights, safetensors in the HF layout, with an
MTP head whose layer copies a full-attention layer so that drafts are sometimes accepted), loads
it with the engine's standalone loader and generates with MTP off and on at two very different
``max_length`` values, plus the capacity-bound "masked" attention that ComfyUI uses today.
Part 2 times one decode-attention call against cache capacity (``benchmarks/capacity_demo.py``).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.engine import Qwen35Config, bind, generate, load_standalone  # noqa: E402

from benchmarks.capacity_demo import run as capacity_demo  # noqa: E402

NEW_TOKENS = 160
PROMPT_TOKENS = 24


def demo_config() -> Qwen35Config:
    """8 layers (DeltaNet x3 + attention, twice), hidden 256, vocabulary 1024."""
    return Qwen35Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, conv_kernel_size=4, lm_head=True,
        layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",))


def random_weights(cfg: Qwen35Config, seed: int = 0, strength: float = 0.1) -> dict[str, torch.Tensor]:
    """Random tensors for every canonical name (randomised norms; small output projections keep the
    residual stream close to the token embedding, so the next token mostly follows the current one)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cfg.text_shapes().items():
        if name == "embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name.endswith("A_log"):
            t = torch.rand(shape, generator=g) * 2 - 1
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1 + 0.2 * torch.randn(shape, generator=g)  # plain-w gated norm
        elif len(shape) == 1:
            t = 0.2 * torch.randn(shape, generator=g)  # (1 + w) norms
        elif name.endswith("conv1d.weight"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            scale = strength if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0
            scale = 4.0 if name == "lm_head.weight" else scale
            t = torch.randn(shape, generator=g) * (scale / shape[-1] ** 0.5)
        out[name] = t
    # MTP head: fc passes the embedding half through, the layer copies the last full-attention layer.
    h = cfg.hidden_size
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)
    out["mtp.fc.weight"] = fc + 0.02 / h ** 0.5 * torch.randn(h, 2 * h, generator=g)
    out["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    out["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(h)
    out["mtp.norm.weight"] = out["norm.weight"].clone()
    last = cfg.full_attention_layers[-1]
    for name in cfg.layer_shapes("full_attention"):
        out[f"mtp.layers.0.{name}"] = out[f"layers.{last}.{name}"].clone()
    return out


def save_hf(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    def hf_name(name: str) -> str:
        return name if name.startswith(("mtp.", "lm_head.")) else f"model.language_model.{name}"

    save_file({hf_name(k): v.contiguous() for k, v in tensors.items()}, str(path))


class _Enough(Exception):
    pass


def timed_generate(model, prompt, *, max_length: int, mtp, attention: str, **kw):
    """Generate NEW_TOKENS tokens inside a cache sized for ``max_length`` (the callback stops early,
    the way ComfyUI's Cancel does); returns (tokens, stats)."""
    seen = {}

    def stop(all_tokens, new, stats):
        if len(all_tokens) >= NEW_TOKENS:
            seen.update(tokens=all_tokens[:NEW_TOKENS], stats=stats)
            raise _Enough

    try:
        res = generate(model, prompt, max_length=max_length, mtp=mtp, attention=attention, stop_tokens=[],
                       callback=stop, **kw)
        return res.tokens, res.stats
    except _Enough:
        return seen["tokens"], seen["stats"]


def part1() -> None:
    torch.manual_seed(0)
    cfg = demo_config()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen35-demo.safetensors"
        t0 = time.perf_counter()
        save_hf(random_weights(cfg), path)
        model = load_standalone(path)
        mb = path.stat().st_size / 2**20
        print(f"Qwen3.5 demo model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
              f"({len(cfg.linear_attention_layers)} Gated DeltaNet + {len(cfg.full_attention_layers)} attention), "
              f"vocabulary {cfg.vocab_size}, MTP head; {mb:.1f} MiB safetensors written and loaded with "
              f"load_standalone in {time.perf_counter() - t0:.2f} s")
    b = bind(model)
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    prompt = b.embed(ids, torch.float32, "cpu")
    print(f"prompt: {PROMPT_TOKENS} random tokens; greedy, {NEW_TOKENS} new tokens per run "
          f"({torch.get_num_threads()} CPU threads)\n")
    header = f"{'attention':>9} {'max_length':>10} {'MTP':>4} {'steps':>6} {'accepted':>9} {'tok/s':>7} {'ms/token':>9}"
    print(header)
    runs = [("torch", 256, "off"), ("torch", 256, 3), ("torch", 65536, "off"), ("torch", 65536, 3),
            ("masked", 256, "off"), ("masked", 65536, "off")]
    outputs = []
    for attention, max_length, mtp in runs:
        tokens, s = timed_generate(model, prompt, max_length=max_length, mtp=mtp, attention=attention,
                                   do_sample=False)
        outputs.append(tokens)
        acc = f"{100 * s.acceptance_rate:.0f}%" if s.mtp_depth else "-"
        ms = 1e3 * s.decode_s / max(1, s.tokens - 1)
        print(f"{attention:>9} {max_length:>10} {str(mtp):>4} {s.steps:>6} {acc:>9} {s.tok_per_s:>7.1f} {ms:>9.2f}",
              flush=True)
    same = all(t == outputs[0] for t in outputs)
    print(f"\ntokens identical in every run (MTP on/off, both max_lengths, both attentions): {'yes' if same else 'NO'}")
    print(f"first 24 tokens: {outputs[0][:24]} ({len(set(outputs[0]))} distinct in {NEW_TOKENS}: a random "
          "model this predictable is what lets a copied-layer MTP head guess right)")
    print("'torch' reads only the filled cache slots, so its time per token does not depend on max_length;")
    print("'masked' (what ComfyUI does today) attends over the whole capacity, so it slows as max_length grows.")

    pe = dict(do_sample=True, temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5, seed=42)
    tokens, s = timed_generate(model, prompt, max_length=16256, mtp=3, attention="torch", **pe)
    print(f"\nsampled with the prompt enhancer's settings (T=1.0, top_p 0.95, top_k 20, presence 1.5), MTP 3: "
          f"{s.accepted}/{s.drafted} drafts accepted ({100 * s.acceptance_rate:.0f}%), {s.tok_per_s:.1f} tok/s")
    print(f"first 24 tokens: {tokens[:24]}")


if __name__ == "__main__":
    print("== Part 1: Qwen3.5 engine on a small checkpoint built here ==")
    part1()
    print("\n== Part 2: one decode-attention call against cache capacity ==")
    capacity_demo()
