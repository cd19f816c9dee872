"""Parsers that read untrusted text stay bounded: the answer parser on deeply nested or brace-flooded
answers (no RecursionError, linear time, the answer's text kept), the safetensors header parser on
headers safetensors itself refuses, and the MTP head reader on malformed quantization markers and
non-finite values.
"""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch
from qwen35_fast.downloads.hub_client import FetchError
from qwen35_fast.downloads.safetensors_header import local_header
from qwen35_fast.enhancer.enhancer_answer import parse_answer
from qwen35_fast.patches import mtp_graft
from safetensors.torch import save_file


@pytest.mark.parametrize("answer, prompt", [
    ('{"rewritten_prompt": ' + "[" * 5000, None),                           # raw RecursionError before
    ("[" * 3000 + '{"rewritten_prompt": "a cat", "wh_ratio": "1:1"}' + "]" * 3000, "a cat"),
    ('{"a":' * 50000, None),
    ("{" * 200_000, None),                                                   # 6 s before
    ('{"rewritten_prompt": "a dog", "wh_ratio": "4:3"} ' + "{" * 200_000, "a dog"),
    ('{"x": ' + "{" * 2000 + ' "rewritten_prompt": "a bird"', "a bird"),   # salvaged after its key
])
def test_answer_parser_is_bounded(answer, prompt):
    start = time.perf_counter()
    got = parse_answer(answer)
    assert time.perf_counter() - start < 2.0
    if prompt is None:
        assert got.parse_ok is False and got.rewritten_prompt == answer.strip()  # the documented fallback
    else:
        assert got.parse_ok is True and got.rewritten_prompt == prompt


def _file(path, header: dict | bytes, data: bytes) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, bytes(8), "malformed"),
    ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8), "malformed"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "gap of 4 bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "4 bytes follow the last tensor"),
    ({"__metadata__": {"k": 1}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
     "__metadata__ must map strings to strings"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"", "not a flat JSON object"),
])
def test_header_parser_follows_safetensors_rules(tmp_path, header, data, match):
    path = _file(tmp_path / "x.safetensors", header, data)
    with pytest.raises(FetchError, match=match):
        local_header(path)
    if not isinstance(header, bytes):  # safetensors itself refuses each of these files too
        from safetensors import safe_open

        with pytest.raises(Exception):  # noqa: B017 - safetensors' error types differ between versions
            with safe_open(path, framework="pt"):
                pass


def test_mtp_head_reader_names_malformed_markers_and_non_finite_values(tmp_path):
    good = {"mtp.fc.weight": torch.ones(4, 8)}
    marker = {"mtp.fc.weight": torch.ones(4, 8, dtype=torch.int8), "mtp.fc.weight_scale": torch.ones(()),
              "mtp.fc.comfy_quant": torch.tensor(list(b"{not json"), dtype=torch.uint8)}
    save_file(marker, str(tmp_path / "marker.safetensors"))
    with pytest.raises(mtp_graft.MTPHeadError, match="quantization marker 'mtp.fc.comfy_quant' is not JSON"):
        mtp_graft.read_mtp_tensors(str(tmp_path / "marker.safetensors"))
    nan = {**good, "mtp.norm.weight": torch.tensor([1.0, float("nan")])}
    save_file(nan, str(tmp_path / "nan.safetensors"))
    with pytest.raises(mtp_graft.MTPHeadError, match="mtp.norm.weight holds NaN or infinite values.*'none'"):
        mtp_graft.read_mtp_tensors(str(tmp_path / "nan.safetensors"))
    save_file(good, str(tmp_path / "good.safetensors"))
    assert torch.equal(mtp_graft.read_mtp_tensors(str(tmp_path / "good.safetensors"))["mtp.fc.weight"],
                       good["mtp.fc.weight"])
