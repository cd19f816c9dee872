"""Standalone loader: both layouts, dtypes, grafted MTP head, and a clear error for every bad file."""

from __future__ import annotations

import pytest
import torch
from qwen35_fast.engine import Qwen35Config, Qwen35Error, build_mtp_head, generate, load_standalone
from safetensors.torch import save_file

from tests.oracles.tiny import add_mtp, make_tiny, save, to_layout


@pytest.fixture
def tiny(rng):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2)
    return add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05), d


def _text(sd):
    return {k: v for k, v in sd.items() if not k.startswith("mtp.")}


def _mtp(sd):
    return {k: v for k, v in sd.items() if k.startswith("mtp.")}


def test_layouts_load_the_same_model(tmp_path, tiny, rng):
    sd, d = tiny
    hf = to_layout(sd, "hf")
    hf["model.visual.blocks.0.norm1.weight"] = torch.ones(8)  # vision tensors are ignored
    save_file(hf, str(tmp_path / "hf.safetensors"))
    models = [load_standalone(tmp_path / "hf.safetensors"),
              load_standalone(save(sd, tmp_path / "comfy.safetensors", "comfyui")),
              load_standalone(save(sd, tmp_path / "bare.safetensors", "bare"))]
    for m in models:
        assert m.model.mtp is not None and m.mtp is m.model.mtp
        assert m.config.mtp_num_hidden_layers == 1 and m.config.vocab_size == d["vocab_size"]
        for name, t in sd.items():
            assert torch.equal(m.model.get_parameter(name), t), name
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    outs = [generate(m, prompt, do_sample=False, max_length=12, mtp=2).tokens for m in models]
    assert outs[0] == outs[1] == outs[2]


def test_dtypes(tmp_path, tiny, rng):
    sd, d = tiny
    path = save({k: v.to(torch.bfloat16) for k, v in sd.items()}, tmp_path / "bf16.safetensors")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        m = load_standalone(path, dtype=dtype)
        assert {p.dtype for p in m.parameters()} == {dtype}
        res = generate(m, torch.randn(4, d["hidden_size"], generator=rng), do_sample=False, max_length=6, mtp=2)
        assert len(res.tokens) == 6
    with pytest.raises(Qwen35Error, match="dtype must be"):
        load_standalone(path, dtype=torch.int8)


def test_grafted_mtp_head(tmp_path, tiny, rng):
    sd, d = tiny
    main = save(_text(sd), tmp_path / "main.safetensors", "hf")
    head = save(_mtp(sd), tmp_path / "mtp.safetensors", "hf")
    whole = load_standalone(save(sd, tmp_path / "whole.safetensors", "hf"))
    plain = load_standalone(main)
    assert plain.mtp is None and plain.config.mtp_num_hidden_layers == 0
    grafted = load_standalone(main, mtp_path=head)
    assert grafted.mtp is not None
    with open(main, "rb") as f:
        raw = f.read()
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    a = generate(whole, prompt, do_sample=False, max_length=16, mtp=3)
    b = generate(grafted, prompt, do_sample=False, max_length=16, mtp=3)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted
    with open(main, "rb") as f:
        assert f.read() == raw  # the first file is never rewritten
    # grafting in memory onto a loaded model, the way the ComfyUI loader attaches it
    plain.model.mtp = build_mtp_head(_mtp(sd), plain.config)
    assert generate(plain, prompt, do_sample=False, max_length=16, mtp=3).tokens == a.tokens
    plain.mtp = None  # the root's .mtp is the decoder's
    assert plain.model.mtp is None and generate(plain, prompt, max_length=2, mtp="auto").stats.mtp_depth == 0
    with pytest.raises(Qwen35Error, match="no 'mtp"):
        load_standalone(main, mtp_path=main)


def test_build_mtp_head_checks_every_shape(tiny):
    sd, d = tiny
    cfg = Qwen35Config.from_state_dict(_text(sd))
    head = _mtp(sd)
    assert build_mtp_head({"model." + k: v for k, v in head.items()}, cfg) is not None
    with pytest.raises(Qwen35Error, match="no 'mtp"):
        build_mtp_head(_text(sd), cfg)
    for name in ("mtp.fc.weight", "mtp.layers.0.self_attn.k_norm.weight", "mtp.norm.weight"):
        broken = dict(head)
        del broken[name]
        with pytest.raises(Qwen35Error, match=f"missing tensor '{name}'"):
            build_mtp_head(broken, cfg)
        broken = dict(head)
        broken[name] = torch.zeros(*[s + 1 for s in head[name].shape])
        with pytest.raises(Qwen35Error, match=f"'{name}' has shape"):
            build_mtp_head(broken, cfg)
    wrong_model = cfg.replace(hidden_size=cfg.hidden_size * 2)
    with pytest.raises(Qwen35Error, match="has shape"):
        build_mtp_head(head, wrong_model)


@pytest.mark.parametrize("layout", ["hf", "comfyui"])
def test_bad_files_name_the_tensor(tmp_path, tiny, layout):
    sd, _ = tiny
    text = _text(sd)
    prefix = "model.language_model." if layout == "hf" else "model."

    def write(tensors, name):
        return save(tensors, tmp_path / f"{name}-{layout}.safetensors", layout)

    missing = dict(text)
    del missing["layers.1.linear_attn.in_proj_z.weight"]
    with pytest.raises(Qwen35Error, match=f"missing tensor '{prefix}layers.1.linear_attn.in_proj_z.weight'"):
        load_standalone(write(missing, "missing"))

    shaped = dict(text)
    shaped["layers.3.self_attn.o_proj.weight"] = torch.zeros(3, 5)
    with pytest.raises(Qwen35Error, match=f"'{prefix}layers.3.self_attn.o_proj.weight' has shape"):
        load_standalone(write(shaped, "shape"))

    extra = dict(text)
    extra["layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(Qwen35Error, match=f"unexpected tensor '{prefix}layers.0.mlp.experts"):
        load_standalone(write(extra, "extra"))

    llama = {k: v for k, v in text.items() if ".linear_attn." not in k}
    for i in range(3):  # every layer plain attention: a Qwen3/Llama-style decoder
        llama.update({k.replace("layers.3.", f"layers.{i}."): v.clone() for k, v in text.items()
                      if k.startswith("layers.3.self_attn.")})
    with pytest.raises(Qwen35Error, match="not a Qwen3.5 checkpoint"):
        load_standalone(write(llama, "llama"))

    bad_mtp = dict(sd)
    bad_mtp["mtp.fc.weight"] = torch.zeros(4, 4)
    with pytest.raises(Qwen35Error, match="'mtp.fc.weight' has shape"):
        load_standalone(write(bad_mtp, "badmtp"))


def test_unreadable_files(tmp_path, tiny):
    sd, _ = tiny
    good = save(sd, tmp_path / "good.safetensors")
    raw = open(good, "rb").read()
    for name, data in (("truncated", raw[: len(raw) // 2]), ("header-cut", raw[:20]), ("empty", b""),
                       ("text", b"this is not safetensors")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(Qwen35Error, match="truncated or corrupt"):
            load_standalone(path)
    with pytest.raises(Qwen35Error, match="no such file"):
        load_standalone(tmp_path / "nope.safetensors")
    quant = to_layout(_text(sd), "hf")
    quant["model.language_model.layers.0.mlp.down_proj.comfy_quant"] = torch.tensor([1], dtype=torch.uint8)
    save_file(quant, str(tmp_path / "quant.safetensors"))
    with pytest.raises(Qwen35Error, match="quantized checkpoint"):
        load_standalone(tmp_path / "quant.safetensors")
    ints = dict(_text(sd))
    ints["norm.weight"] = torch.zeros(sd["norm.weight"].shape, dtype=torch.int32)
    with pytest.raises(Qwen35Error, match="'model.language_model.norm.weight' has dtype"):
        load_standalone(save(ints, tmp_path / "ints.safetensors"))
