"""The 4-bit converter (``patches/convert_4bit.py``): its file is ComfyUI's format (per-layer comfy_quant and
the header's ``_quantization_metadata``), round-trips (ComfyUI's dequantization of the written tensors
== the converter's own), is streamed atomically, never overwrites, and stops on Cancel."""

import json

import pytest
import torch
from qwen35_fast.kernels.packed4 import Packed4, dequantize
from qwen35_fast.patches import convert_4bit, quant_values

from tests.oracles.comfy_tree import int8_convrot
from tests.oracles.tiny import make_tiny, to_layout

ck = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt) quantizes")
LAYOUTS = {"convrot_w4a4": "TensorCoreConvRotW4A4Layout", "nvfp4": "TensorCoreNVFP4Layout"}


def source_file(tmp_path, kind: str):
    """A tiny Qwen3.5 file 256 wide (so ConvRot 256 applies) in the HF layout, bf16 or int8_convrot."""
    from safetensors.torch import save_file

    sd, _ = make_tiny(3, hidden_size=256, intermediate_size=256)
    sd = {k: v.to(torch.bfloat16) for k, v in to_layout(sd, "hf").items()}
    if kind == "int8_convrot":
        sd = int8_convrot({k: v.float() for k, v in sd.items()}, group=64)
    path = tmp_path / f"tiny.{kind}.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def comfy_weight(f, layer: str, conf: dict, shape) -> torch.Tensor:
    """The weight as ComfyUI's loader builds and dequantizes it (``comfy/ops.py``: Params from the stored
    ``weight_scale`` / ``weight_scale_2`` and the layer's comfy_quant)."""
    q = f.get_tensor(layer + ".weight")
    if conf["format"] == "convrot_w4a4":
        params = ck.TensorCoreConvRotW4A4Layout.Params(
            scale=f.get_tensor(layer + ".weight_scale"), convrot_groupsize=conf["convrot_groupsize"],
            quant_group_size=64, orig_dtype=torch.float32, orig_shape=tuple(shape))
    else:
        params = ck.TensorCoreNVFP4Layout.Params(
            scale=f.get_tensor(layer + ".weight_scale_2"),
            block_scale=f.get_tensor(layer + ".weight_scale").view(torch.float8_e4m3fn),
            orig_dtype=torch.float32, orig_shape=tuple(shape))
    return ck.QuantizedTensor(q, LAYOUTS[conf["format"]], params).dequantize()


@pytest.mark.parametrize("fmt, kind, device", [
    ("convrot_w4a4", "int8_convrot", "cpu"), ("nvfp4", "bf16", "cpu"),
    pytest.param("nvfp4", "int8_convrot", "cuda", marks=pytest.mark.gpu),  # kitchen's CUDA quantizer: no float32
    pytest.param("convrot_w4a4", "int8_convrot", "cuda", marks=pytest.mark.gpu)])
def test_converted_file_is_comfys_format_and_round_trips(tmp_path, monkeypatch, kind, fmt, device):
    from safetensors import safe_open

    monkeypatch.setattr(quant_values, "EMBEDDING_ROWS", 7)  # the table in several slices, the last ragged
    src = source_file(tmp_path, kind)
    seen, errors = [], {}
    out = convert_4bit.convert(src, tmp_path, fmt, progress=lambda d, t, k: seen.append((d, t)), errors=errors,
                               device=device)
    assert out.name == f"tiny.{fmt}.safetensors" and not list(tmp_path.glob("*.part"))
    steps = convert_4bit.plan(src, fmt)
    assert seen[-1] == (len(steps), len(steps)) and len(seen) == len(steps)
    done = [s.key for s in steps if s.action == "quantize"]
    kept = {s.key: s.why for s in steps if s.action == "keep"}
    assert "lm_head.weight" in kept and [s.key for s in steps if s.action == "int8"] == [convert_4bit.EMBEDDING]
    assert set(errors) == set(done) | {convert_4bit.EMBEDDING} and all(0 < e < 0.2 for e in errors.values()), errors
    assert errors[convert_4bit.EMBEDDING] < 0.01  # int8, a scale per row
    with safe_open(str(out), framework="pt") as f, safe_open(str(src), framework="pt") as s:
        layers = json.loads(f.metadata()["_quantization_metadata"])
        assert layers["format_version"] == "1.0"
        for key in done:
            layer = key[: -len(".weight")]
            conf = json.loads(bytes(f.get_tensor(layer + ".comfy_quant").tolist()))
            assert conf == layers["layers"][layer] == (
                {"format": fmt, "convrot_groupsize": 256} if fmt == "convrot_w4a4" else {"format": fmt})
            shape = s.get_slice(key).get_shape()
            scale = f.get_tensor(layer + (".weight_scale" if fmt == "convrot_w4a4" else ".weight_scale_2"))
            block = f.get_tensor(layer + ".weight_scale") if fmt == "nvfp4" else None
            own = dequantize(Packed4(fmt, f.get_tensor(key), scale, block, *shape, 256 if fmt == "convrot_w4a4" else 0))
            assert torch.allclose(comfy_weight(f, layer, conf, shape), own, rtol=1e-6, atol=1e-7), key
        for key in kept:  # as the source holds them, int8 layers with their scales and comfy_quant
            assert torch.equal(f.get_tensor(key), s.get_tensor(key))
        table = "model.language_model.embed_tokens"  # ComfyUI's int8_tensorwise, one scale per row
        assert layers["layers"][table] == json.loads(bytes(f.get_tensor(table + ".comfy_quant").tolist())) == \
            {"format": "int8_tensorwise"}
        q, scale, ref = f.get_tensor(table + ".weight"), f.get_tensor(table + ".weight_scale"), s.get_tensor(
            table + ".weight").float()
        assert q.dtype == torch.int8 and scale.shape == (q.shape[0], 1) and q.shape == ref.shape
        own = ck.QuantizedTensor(q, "TensorWiseINT8Layout", ck.TensorWiseINT8Layout.Params(
            scale=scale, orig_dtype=torch.float32, orig_shape=tuple(q.shape))).dequantize()
        assert torch.equal(own, q.float() * scale) and ((own - ref).norm() / ref.norm()).item() < 0.01
        if kind == "int8_convrot":
            assert layers["layers"]["lm_head"]["format"] == "int8_tensorwise"
            assert torch.equal(f.get_tensor("lm_head.weight_scale"), s.get_tensor("lm_head.weight_scale"))
    if fmt == "convrot_w4a4":  # o_proj (128 wide here) cannot take ConvRot 256: kept, and said
        assert any("ConvRot group 256" in why for why in kept.values())


def test_w4a4_rows_are_clipped_where_that_lowers_the_error(rng):
    """``w4a4_input``: kitchen's own quantizer, given each row clipped (in ConvRot's rotated basis) at
    its best threshold, stores rows ComfyUI dequantizes closer to the weight: never worse a row, and
    a quarter less error on Gaussian rows (absmax / 7 spends the 15 levels on a few outliers)."""
    w = torch.randn(48, 1024, generator=rng) * 0.02
    w[3, 7] = 0.4  # one row with a lone outlier

    def rows_error(src):
        got = ck.QuantizedTensor.from_float(src, "TensorCoreConvRotW4A4Layout", convrot_groupsize=256).dequantize()
        return (got.float() - w).square().sum(1)

    plain, clipped = rows_error(w), rows_error(convert_4bit.w4a4_input(w))
    assert torch.all(clipped <= plain * 1.01), (clipped / plain).max()
    assert clipped.sum() < 0.75 * plain.sum(), (clipped.sum() / plain.sum()).item()


def test_a_tied_embedding_stays_as_the_source_has_it(tmp_path):
    """Without its own ``lm_head`` (the smaller sizes) the embedding is also the output projection: kept, said."""
    from safetensors.torch import load_file, save_file

    src = source_file(tmp_path, "bf16")
    sd = load_file(str(src))
    del sd["lm_head.weight"]
    tied = tmp_path / "tied.bf16.safetensors"
    save_file(sd, str(tied))
    steps = {s.key: s for s in convert_4bit.plan(tied, "convrot_w4a4")}
    table = steps[convert_4bit.EMBEDDING]
    assert table.action == "keep" and "tied" in table.why
    assert not any(s.action == "int8" for s in steps.values())


def test_never_overwrites_and_cancel_leaves_nothing(tmp_path):
    src = source_file(tmp_path, "bf16")
    calls = []
    with pytest.raises(convert_4bit.ConversionCancelled):
        convert_4bit.convert(src, tmp_path, "nvfp4", device="cpu", cancelled=lambda: calls.append(1) or len(calls) > 3)
    assert not list(tmp_path.glob("tiny.nvfp4*"))
    out = tmp_path / "tiny.nvfp4.safetensors"
    out.write_bytes(b"mine")
    with pytest.raises(convert_4bit.ConversionError, match="never overwritten"):
        convert_4bit.convert(src, tmp_path, "nvfp4", device="cpu")
    assert out.read_bytes() == b"mine"
    with pytest.raises(ValueError, match="one of"):
        convert_4bit.plan(src, "int3")
    assert convert_4bit.output_name("qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors", "convrot_w4a4") == \
        "qwen3.5_9b_qwen_image_2.1_pe_t2i.convrot_w4a4.safetensors"


def test_quality_script_runs_at_a_tiny_size():
    """``benchmarks/quant_quality.py`` (the GPU measurement of KL / top-1 on the random 9B) at a tiny size."""
    from benchmarks import quant_quality

    out = quant_quality.run(quant_quality.config_tiny(), 6, "cpu", variants=("w4a4<-int8",))
    row = out["variants"]["w4a4<-int8"]
    assert row["layers"] > 0 and 0 < row["weight_err_median"] < 0.2 and 0 <= row["kl_mean"] < 0.1
    assert 0 <= row["top1_agree"] <= 1
