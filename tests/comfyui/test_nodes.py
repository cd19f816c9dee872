"""Node schemas and execute paths against the stand-in ComfyUI in tests/comfy_stub.

The fake CLIP below has ComfyUI's shape (cond_stage_model.<name> with process_tokens / generate /
transformer.model, a patcher with object patches applied while generating, a tokenizer with
ComfyUI's Qwen3.5 image-pad convention). ``engine.generate`` is replaced by a scripted generator
so these tests check the node layer (routing, positions, presets, parsing, errors, progress and
Cancel) independently of the engine, which has its own oracle tests.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

STUB = Path(__file__).resolve().parents[1] / "comfy_stub"
if str(STUB) not in sys.path:
    sys.path.insert(0, str(STUB))

import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
import comfy_execution.utils as exec_utils  # noqa: E402
import folder_paths  # noqa: E402
import server  # noqa: E402
from qwen35_fast.engine.errors import Qwen35Error  # noqa: E402
from qwen35_fast.enhancer import prompt_enhancer  # noqa: E402
from qwen35_fast.kernels import ATTENTION_BACKENDS  # noqa: E402
from qwen35_fast.nodes import extension  # noqa: E402
from qwen35_fast.nodes.enhancer_node import Qwen35PromptEnhancer  # noqa: E402
from qwen35_fast.nodes.loader_node import Qwen35CLIPLoader  # noqa: E402
from qwen35_fast.nodes.patch_node import Qwen35LengthAwarePatch  # noqa: E402
from qwen35_fast.patches import clip_patch, mtp_graft  # noqa: E402
from qwen35_fast.patches import comfy_bridge as bridge  # noqa: E402

SPECIAL = {"<|im_start|>": 248045, "<|im_end|>": 248046, "<|endoftext|>": 248044, "<think>": 248068,
           "</think>": 248069, "<|image_pad|>": 248056, "<|vision_start|>": 248053, "<|vision_end|>": 248054}
SPECIAL_IDS = {v: k for k, v in SPECIAL.items()}
HIDDEN = 8
IMAGE_TOKENS = 4  # a 4x4 patch grid merges 2x2 -> 4 tokens


# ---------------------------------------------------------------------------------------------
# a ComfyUI-shaped fake CLIP


class FakeTokenizer:
    def __init__(self):
        self.texts = []

    def tokenize_with_weights(self, text, return_word_ids=False, images=(), **kw):
        self.texts.append(text)
        ids, i, n_img = [], 0, 0
        while i < len(text):
            for s, tid in SPECIAL.items():
                if text.startswith(s, i):
                    if tid == 248056 and n_img < len(images):
                        ids.append(({"type": "image", "data": images[n_img]}, 1.0))
                        n_img += 1
                    else:
                        ids.append((tid, 1.0))
                    i += len(s)
                    break
            else:
                ids.append((ord(text[i]) + 10, 1.0))
                i += 1
        return {"qwen35_test": [ids]}

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for t in ids:
            if t in SPECIAL_IDS:
                if not skip_special_tokens or t in (248068, 248069):
                    out.append(SPECIAL_IDS[t])
            else:
                out.append(chr(t - 10))
        return "".join(out)


def encode(text):
    return [tid for tid, _ in FakeTokenizer().tokenize_with_weights(text)["qwen35_test"][0]]


class FakeTransformer(torch.nn.Module):
    def __init__(self, qwen=True):
        super().__init__()
        self.model = torch.nn.Module()
        layer = torch.nn.Module()
        if qwen:
            layer.linear_attn = torch.nn.Linear(2, 2)
        else:
            layer.self_attn = torch.nn.Linear(2, 2)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.embed = torch.nn.Embedding(300000, HIDDEN)
        self.model.config = SimpleNamespace(stop_tokens=[248044, 248046])
        self.core_calls = []

    def get_input_embeddings(self):
        return self.model.embed

    def generate(self, embeds, *args, **kwargs):
        self.core_calls.append(embeds.shape)
        return [1, 2, 3]


class FakeSDClip:
    def __init__(self, qwen=True):
        self.transformer = FakeTransformer(qwen)
        self.execution_device = torch.device("cpu")

    def process_tokens(self, tokens, device):
        embeds, info = [], []
        for row in tokens:
            parts = []
            for t in row:
                if isinstance(t, dict):
                    info.append({"type": "image", "index": sum(p.shape[0] for p in parts), "size": IMAGE_TOKENS,
                                 "extra": torch.tensor([[1, 4, 4]])})
                    parts.append(torch.ones(IMAGE_TOKENS, HIDDEN))
                else:
                    parts.append(self.transformer.model.embed(torch.tensor([t])).detach())
            embeds.append(torch.cat(parts))
        return torch.stack(embeds), None, None, info

    def generate(self, tokens, do_sample, max_length, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                 presence_penalty=0.0):
        tokens_only = [[t[0] for t in b] for b in next(iter(tokens.values()))]
        embeds = self.process_tokens(tokens_only, self.execution_device)[0]
        return self.transformer.generate(embeds, do_sample, max_length)


class FakePatcher:
    def __init__(self, model, model_options=None, object_patches=None, paths=()):
        self.model = model
        self.model_options = model_options if model_options is not None else {}
        self.object_patches = dict(object_patches or {})
        self.cached_patcher_init = (None, (list(paths),))

    def clone(self):
        import copy
        return FakePatcher(self.model, copy.deepcopy(self.model_options), self.object_patches,
                           self.cached_patcher_init[1][0])

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj


class FakeCLIP:
    def __init__(self, qwen=True, paths=(), patcher=None, csm=None, tokenizer=None):
        if csm is None:
            csm = SimpleNamespace(clip="qwen35_test", qwen35_test=FakeSDClip(qwen))
        self.cond_stage_model = csm
        self.patcher = patcher or FakePatcher(csm, paths=paths)
        self.tokenizer = tokenizer or FakeTokenizer()

    def clone(self):
        return FakeCLIP(patcher=self.patcher.clone(), csm=self.cond_stage_model, tokenizer=self.tokenizer)

    def tokenize(self, text, return_word_ids=False, **kw):
        out = self.tokenizer.tokenize_with_weights(text, return_word_ids, **kw)
        self.last_tokens = next(iter(out.values()))[0]
        return out

    def generate(self, tokens, do_sample=True, max_length=256, temperature=1.0, top_k=50, top_p=0.95, min_p=0.0,
                 repetition_penalty=1.0, seed=None, presence_penalty=0.0):
        backup = {k: comfy.utils.set_attr(self.cond_stage_model, k, v) for k, v in self.patcher.object_patches.items()}
        try:
            return getattr(self.cond_stage_model, self.cond_stage_model.clip).generate(
                tokens, do_sample=do_sample, max_length=max_length, temperature=temperature, top_k=top_k,
                top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                presence_penalty=presence_penalty)
        finally:
            for k, v in backup.items():
                comfy.utils.set_attr(self.cond_stage_model, k, v)
            for k in backup:  # drop the instance attributes again, as if never patched
                obj, name = self.cond_stage_model, k.split(".")
                for p in name[:-1]:
                    obj = getattr(obj, p)
                obj.__dict__.pop(name[-1], None)

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class ScriptedEngine:
    """Stands in for engine.generate: emits ``reply`` token by token through the callback."""

    def __init__(self, reply="ok", interrupt_at=None):
        self.reply_ids = encode(reply) + [248046]
        self.calls = []
        self.interrupt_at = interrupt_at

    def __call__(self, module, embeds, **kw):
        self.calls.append(dict(kw, module=module, embeds=embeds))
        out = []
        for i, t in enumerate(self.reply_ids[: kw["max_length"]]):
            out.append(t)
            if self.interrupt_at is not None and i == self.interrupt_at:
                mm.interrupt_current_processing(True)
            kw["callback"](list(out), [t], None)
        stats = SimpleNamespace(tokens=len(out), steps=len(out), drafted=0, accepted=0, acceptance_rate=0.0,
                                prefill_s=0.01, decode_s=0.1, tok_per_s=10.0, mtp_depth=0, attention_backend="torch")
        return SimpleNamespace(tokens=out, stats=stats, stop_reason="stop_token")


@pytest.fixture
def scripted(monkeypatch):
    def install(reply="ok", interrupt_at=None):
        eng = ScriptedEngine(reply, interrupt_at)
        monkeypatch.setattr(bridge, "generate", eng)
        return eng
    mm.interrupt_current_processing(False)
    server.PromptServer.instance.texts.clear()
    comfy.utils.UPDATES.clear()
    yield install
    mm.interrupt_current_processing(False)
    exec_utils.NODE_ID = None


# ---------------------------------------------------------------------------------------------
# schemas


def schemas():
    return {cls: cls.define_schema() for cls in extension.NODES}


def test_entrypoint_lists_the_four_nodes():
    from qwen35_fast import comfy_entrypoint

    ext = asyncio.run(comfy_entrypoint())
    nodes = asyncio.run(ext.get_node_list())
    assert {n.define_schema().node_id for n in nodes} == {
        "Qwen35FastCLIPLoader", "Qwen35FastPromptEnhancer", "Qwen35FastLengthAwarePatch",
        "Qwen35FastPromptEnhancerServer", "Qwen35FastSave4bit"}
    import qwen35_fast
    assert not hasattr(qwen35_fast, "NODE_CLASS_MAPPINGS")


def test_user_errors_render_as_short_type_names():
    """ComfyUI's execution.full_type_name (module + qualname) shows the pack's errors without the
    pack folder's path once the entrypoint ran."""
    from qwen35_fast import comfy_entrypoint
    from qwen35_fast.downloads.hub_client import FetchError

    asyncio.run(comfy_entrypoint())

    def full_type_name(klass):  # ComfyUI 0.29.0's execution.full_type_name
        return klass.__qualname__ if klass.__module__ == "builtins" else klass.__module__ + "." + klass.__qualname__

    assert full_type_name(FetchError) == "qwen35_fast.FetchError"
    for cls in extension.USER_ERRORS:
        assert full_type_name(cls) == f"qwen35_fast.{cls.__name__}", cls
    from qwen35_fast.patches.convert_checks import NonFinite  # a subclass the converter raises

    assert full_type_name(NonFinite) == "qwen35_fast.NonFinite"


def test_schemas_are_valid_and_complete():
    s = {cls.__name__: sch for cls, sch in schemas().items()}
    for sch in s.values():
        sch.validate()
    pe = {i.id: i for i in s["Qwen35PromptEnhancer"].inputs}
    assert pe["max_length"].max >= 32768 and pe["max_length"].min == 1
    assert pe["seed"].control_after_generate
    assert pe["system_prompt"].multiline and pe["prompt"].multiline
    images = [i for i in s["Qwen35PromptEnhancer"].inputs if i.io_type == "IMAGE"]
    assert [i.id for i in images] == [f"image{k}" for k in range(1, 11)] and all(i.optional for i in images)
    assert pe["system_prompt"].default == prompt_enhancer.OFFICIAL
    # every option a node offers is one the layer below accepts (not a restated list)
    for sch in (s["Qwen35PromptEnhancer"], s["Qwen35LengthAwarePatch"]):
        opts = {i.id: i for i in sch.inputs}
        assert opts["mtp"].default == "auto" and all(bridge.parse_mtp(o) for o in opts["mtp"].options)
        assert all(o == "auto" or o in ATTENTION_BACKENDS for o in opts["attention"].options)
    assert {"1", "5"} <= set(pe["mtp"].options) and set(pe["attention"].options) >= set(ATTENTION_BACKENDS)
    assert all(o == "custom" or prompt_enhancer.preset_settings(o) for o in pe["preset"].options)
    assert pe["thinking"].default is True
    assert [o.display_name for o in s["Qwen35PromptEnhancer"].outputs] == [
        "rewritten_prompt", "thinking", "wh_ratio", "ratio_follow", "width", "height", "parse_ok"]
    assert [o.io_type for o in s["Qwen35PromptEnhancer"].outputs] == ["STRING", "STRING", "STRING", "STRING", "INT",
                                                                       "INT", "BOOLEAN"]
    assert [o.io_type for o in s["Qwen35LengthAwarePatch"].outputs] == ["CLIP"]
    assert s["Qwen35LengthAwarePatch"].display_name == "Length-aware decode (Qwen3.5)"
    assert s["Qwen35PromptEnhancer"].display_name == "Qwen3.5 Prompt Enhancer (MTP)"
    execute_params = __import__("inspect").signature(Qwen35PromptEnhancer.execute).parameters
    takes_rest = any(p.kind is p.VAR_KEYWORD for p in execute_params.values())  # image1..image10
    assert {k for k in pe if not k.startswith("image")} <= set(execute_params) and takes_rest


# ---------------------------------------------------------------------------------------------
# patch node


def test_patch_node_refuses_non_qwen_and_leaves_clip_untouched():
    clip = FakeCLIP(qwen=False)
    with pytest.raises(ValueError, match="not Qwen3.5"):
        Qwen35LengthAwarePatch.execute(clip, mtp="auto", attention="auto")
    assert clip.patcher.object_patches == {} and clip.patcher.model_options == {}
    with pytest.raises(ValueError, match="Expected a ComfyUI CLIP"):
        Qwen35LengthAwarePatch.execute(object(), mtp="auto")
    with pytest.raises(ValueError, match="mtp must be"):
        Qwen35LengthAwarePatch.execute(FakeCLIP(), mtp="7")


def test_patch_node_shows_its_status_on_the_node(scripted):
    """The patch node says on itself whether MTP runs: "MTP off: no head" (the fix named) without one."""
    exec_utils.NODE_ID = "9"
    try:
        clip = FakeCLIP()
        out = Qwen35LengthAwarePatch.execute(clip, mtp="auto")
        shown = [t for nid, t in server.PromptServer.instance.texts if nid == "9"]
        assert shown and shown[-1].startswith("MTP off: no head") and "Load Qwen3.5 CLIP (MTP)" in shown[-1]
        assert out.ui["text"] == [shown[-1]]
        clip.cond_stage_model.qwen35_test.transformer.model.mtp = torch.nn.Linear(2, 2)  # a grafted head
        Qwen35LengthAwarePatch.execute(clip, mtp="auto")
        assert server.PromptServer.instance.texts[-1] == ("9", "MTP auto; length-aware decode on.")
    finally:
        exec_utils.NODE_ID = None


def test_patch_routes_clone_through_engine_and_keeps_core_on_input(scripted):
    eng = scripted("hello")
    clip = FakeCLIP()
    patched = Qwen35LengthAwarePatch.execute(clip, mtp="3", attention="torch").args[0]
    assert set(patched.patcher.object_patches) == {"qwen35_test.generate", "qwen35_test.transformer.generate"}
    assert clip.patcher.object_patches == {}

    tokens = clip.tokenize("hi")
    ids = patched.generate(tokens, do_sample=False, max_length=20, seed=None)
    assert patched.decode(ids) == "hello"
    call = eng.calls[-1]
    assert call["mtp"] == 3 and call["attention"] == "torch" and call["seed"] == 0
    assert call["do_sample"] is False and call["max_length"] == 20
    assert call["stop_tokens"] == [248044, 248046] and call["position_ids"] is None
    assert call["module"] is clip.cond_stage_model.qwen35_test.transformer
    expected = clip.cond_stage_model.qwen35_test.transformer.model.embed(torch.tensor([encode("hi")])).detach()
    assert torch.equal(call["embeds"], expected)

    core = clip.cond_stage_model.qwen35_test.transformer.core_calls
    assert clip.generate(tokens, max_length=5) == [1, 2, 3] and len(core) == 1  # input CLIP: core path
    assert len(eng.calls) == 1


def test_image_prompt_gets_comfyui_mrope_positions(scripted):
    eng = scripted("x")
    clip = FakeCLIP()
    patched = clip_patch.patch_clip(clip)
    image = torch.zeros(1, 32, 32, 3)
    tokens = clip.tokenize("ab<|vision_start|><|image_pad|><|vision_end|>cd", images=[image])
    patched.generate(tokens, max_length=4, seed=5)
    pos = eng.calls[-1]["position_ids"]
    # a, b, <vs> at 0..2; the 4 image tokens (2x2 grid) at t=3, h=3..4, w=3..4; then text from 5
    assert pos.dtype == torch.int64 and pos.shape == (3, 3 + IMAGE_TOKENS + 3)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[0, 3:7].tolist() == [3, 3, 3, 3]
    assert pos[1, 3:7].tolist() == [3, 3, 4, 4] and pos[2, 3:7].tolist() == [3, 4, 3, 4]
    assert pos[:, 7:].tolist() == [[5, 6, 7]] * 3


def test_progress_preview_and_cancel(scripted):
    scripted("abcdef", interrupt_at=2)
    exec_utils.NODE_ID = "17"
    patched = clip_patch.patch_clip(FakeCLIP())
    with pytest.raises(mm.InterruptProcessingException):
        patched.generate(patched.tokenize("q"), max_length=50)
    assert comfy.utils.UPDATES[:3] == [(1, 50), (2, 50), (3, 50)]
    assert server.PromptServer.instance.texts[0] == ("17", "a")
    assert not mm.processing_interrupted()  # the flag was consumed, the next prompt can run


def test_transformer_level_patch_accepts_core_kwargs(scripted):
    eng = scripted("z")
    clip = FakeCLIP()
    patched = clip_patch.patch_clip(clip, mtp="auto")
    fn = patched.patcher.object_patches["qwen35_test.transformer.generate"]
    info = [{"type": "image", "index": 1, "size": 4, "extra": torch.tensor([[1, 4, 4]])}]
    fn(torch.zeros(7, HIDDEN), do_sample=True, max_length=3, seed=9, initial_tokens=[5], embeds_info=info,
       min_tokens=1, mtp=2)
    call = eng.calls[-1]
    assert call["embeds"].shape == (1, 7, HIDDEN) and call["mtp"] == 2 and call["initial_tokens"] == [5]
    assert call["position_ids"][1, 1:5].tolist() == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="deepstack"):
        fn(torch.zeros(1, 3, HIDDEN), deepstack_embeds=[torch.zeros(1)])


# ---------------------------------------------------------------------------------------------
# prompt enhancer


ANSWER = ('The user wants a fox.\n</think>\n\nHere it is.\n'
          '{"rewrited_prompt": "A red fox asleep under a lantern", "wh_ratio": "16:9"}')


def run_pe(clip, **kw):
    args = dict(clip=clip, prompt="a fox", system_prompt="SYS", preset="text-to-image", max_length=400, seed=3,
                mtp="auto", thinking=True, megapixels=1.0)
    args.update(kw)
    return Qwen35PromptEnhancer.execute(**args).args


def test_enhancer_outputs_parsed_answer_and_size(scripted):
    eng = scripted(ANSWER)
    clip = FakeCLIP()
    rewritten, thinking, ratio, follow, width, height, ok = run_pe(clip)
    assert rewritten == "A red fox asleep under a lantern" and ok is True
    assert "The user wants a fox." in thinking and "rewrited" not in thinking
    assert ratio == "16:9" and follow == ""
    assert width % 16 == 0 and height % 16 == 0
    assert abs(width / height - 16 / 9) < 0.05 and abs(width * height - 1024 * 1024) / (1024 * 1024) < 0.1
    text = clip.tokenizer.texts[-1]
    assert text.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\na fox<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    call = eng.calls[-1]
    assert (call["temperature"], call["top_k"], call["top_p"], call["min_p"], call["presence_penalty"]) == \
        (1.0, 20, 0.95, 0.0, 1.5)
    assert call["do_sample"] is True and call["seed"] == 3


def test_enhancer_presets_and_thinking_off(scripted):
    eng = scripted('{"rewritten_prompt": "x", "wh_ratio": "1:1"}')
    clip = FakeCLIP()
    run_pe(clip, preset="edit", thinking=False)
    assert eng.calls[-1]["presence_penalty"] == 0.0
    assert clip.tokenizer.texts[-1].endswith("<think>\n\n</think>\n\n")
    run_pe(clip, preset="custom", temperature=0.5, top_k=7, top_p=0.5, min_p=0.1, presence_penalty=0.25)
    call = eng.calls[-1]
    assert (call["temperature"], call["top_k"], call["top_p"], call["min_p"], call["presence_penalty"]) == \
        (0.5, 7, 0.5, 0.1, 0.25)


def test_enhancer_broken_json_falls_back_to_raw_answer(scripted):
    scripted("thoughts</think>\nJust a plain sentence about a fox.")
    rewritten, _, _, _, width, height, ok = run_pe(FakeCLIP())
    assert ok is False and "plain sentence about a fox" in rewritten
    assert width > 0 and height > 0


def test_enhancer_budget_ends_while_thinking_falls_back_to_user_prompt(scripted, caplog):
    scripted("The user wants a fox. Let me think about the lantern, the snow and")  # no </think>
    exec_utils.NODE_ID = "7"
    with caplog.at_level("WARNING"):
        rewritten, thinking, _, _, width, height, ok = run_pe(FakeCLIP(), prompt="  a fox in the snow ")
    assert rewritten == "a fox in the snow" and ok is False
    assert "Let me think about the lantern" in thinking
    assert width > 0 and height > 0
    assert any("still thinking" in r.getMessage() and "max_length" in r.getMessage() for r in caplog.records)
    assert any("still thinking" in text for _, text in server.PromptServer.instance.texts)


def test_enhancer_thinking_budget_reaches_the_engine_with_the_tokenizers_close(scripted, monkeypatch):
    """thinking_budget N: the engine gets ThinkingBudget(N, ids of "\\n</think>\\n\\n" from the CLIP's own
    tokenizer, the </think> id); 0 or thinking off: none; out of range: refused before any generation. The
    node's first line names the thinking tokens and the cut."""
    from qwen35_fast.engine import ThinkingBudget

    eng = scripted(ANSWER)
    run_pe(FakeCLIP(), thinking_budget=50)
    assert eng.calls[-1]["thinking_budget"] == ThinkingBudget(50, tuple(encode("\n</think>\n\n")), 248069)
    assert encode("\n</think>\n\n") == [ord("\n") + 10, 248069, ord("\n") + 10, ord("\n") + 10]
    run_pe(FakeCLIP(), thinking_budget=0)
    run_pe(FakeCLIP(), thinking_budget=50, thinking=False)
    assert [c["thinking_budget"] for c in eng.calls[-2:]] == [None, None]
    calls = len(eng.calls)
    for bad in (-1, prompt_enhancer.MAX_LENGTH_LIMIT + 1, 2.5):
        with pytest.raises(ValueError, match="thinking_budget must be between 0"):
            run_pe(FakeCLIP(), thinking_budget=bad)
    assert len(eng.calls) == calls

    def cut(module, embeds, **kw):
        res = eng(module, embeds, **kw)
        res.stats.thinking_tokens, res.stats.thinking_cut = 50, True
        return res
    monkeypatch.setattr(bridge, "generate", cut)
    exec_utils.NODE_ID = "7"
    run_pe(FakeCLIP(), thinking_budget=50)
    first = server.PromptServer.instance.texts[-1][1].split("\n")[0]
    assert first.endswith("; thinking 50 tokens, ended by the budget"), first


def with_mtp_stats(eng):
    """``eng`` (a ScriptedEngine) whose results report MTP depth 2 with 7 of 10 drafts accepted."""
    def run(module, embeds, **kw):
        res = eng(module, embeds, **kw)
        res.stats.mtp_depth, res.stats.drafted, res.stats.accepted, res.stats.acceptance_rate = 2, 10, 7, 0.7
        return res
    return run


def test_a_truncated_enhancer_run_warns_once_advice_first_and_keeps_its_stats_on_the_node(scripted, caplog,
                                                                                          monkeypatch):
    """One warning for one cause (the budget ran out while thinking), its first words the fix; the
    node's text keeps that warning on ONE first line and the run's summary (tok/s, acceptance) under it."""
    monkeypatch.setattr(bridge, "generate", with_mtp_stats(scripted("The user wants a fox. Let me think and")))
    exec_utils.NODE_ID = "7"
    with caplog.at_level("WARNING"):
        run_pe(FakeCLIP(), max_length=400)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "Raise max_length" in warned[0], warned
    last = server.PromptServer.instance.texts[-1]
    first, *rest = last[1].split("\n")
    assert last[0] == "7" and first.startswith("Warning: Raise max_length") and "still thinking" in first
    assert "tok/s" in rest[0] and "MTP depth 2, acceptance 70%" in rest[0], rest
    assert "acceptance 70.0% (7/10 drafts)" in rest[1], rest


def test_the_enhancer_node_shows_the_stats_line_first(scripted, monkeypatch):
    """After a run the enhancer's node text starts with one short line of tokens, tok/s and MTP
    acceptance (the node shows its first lines), the details next, the generated text under them."""
    monkeypatch.setattr(bridge, "generate", with_mtp_stats(scripted(ANSWER)))
    exec_utils.NODE_ID = "7"
    run_pe(FakeCLIP())
    node_id, text = server.PromptServer.instance.texts[-1]
    first, second = text.split("\n")[:2]
    tokens = len(encode(ANSWER)) + 1  # the scripted reply and its stop token
    assert node_id == "7" and first == f"{tokens} tokens, 10.0 tok/s, MTP depth 2, acceptance 70%", first
    assert "acceptance 70.0% (7/10 drafts)" in second and "prefill" in second
    assert "The user wants a fox." in text.split("\n\n", 1)[1]


def test_the_patch_node_shows_the_stats_of_the_run_generate_text_made(scripted, monkeypatch):
    """The patch node returns before the generation (core Generate Text runs it later): after that run
    its own text gives the run's tokens, tok/s and MTP acceptance first, then its status."""
    monkeypatch.setattr(bridge, "generate", with_mtp_stats(scripted("hello")))
    exec_utils.NODE_ID = "9"  # the patch node
    clip = FakeCLIP()
    clip.cond_stage_model.qwen35_test.transformer.model.mtp = torch.nn.Linear(2, 2)  # a grafted head
    patched = Qwen35LengthAwarePatch.execute(clip, mtp="2").args[0]
    exec_utils.NODE_ID = "12"  # core Generate Text
    patched.generate(patched.tokenize("hi"), max_length=20)
    on_patch = [t for nid, t in server.PromptServer.instance.texts if nid == "9"]
    state, last, details = on_patch[-1].split("\n")
    assert state == "MTP 2; length-aware decode on."  # the MTP state stays first, in view
    assert last.startswith("Last run: ") and "tok/s" in last and "acceptance 70%" in last
    assert "acceptance 70.0% (7/10 drafts)" in details
    on_generate = [t for nid, t in server.PromptServer.instance.texts if nid == "12"]
    assert "tok/s" in on_generate[-1].split("\n")[0]


def test_enhancer_edit_mode_passes_images_and_positions(scripted):
    eng = scripted('{"rewritten_prompt": "x", "wh_ratio": "1:1"}')
    clip = FakeCLIP()
    bridge.set_clip_info(clip, vision=True)
    run_pe(clip, preset="edit", image1=torch.zeros(2, 32, 32, 3))
    assert clip.tokenizer.texts[-1].count("<|image_pad|>") == 2
    assert eng.calls[-1]["position_ids"] is not None


def test_enhancer_multi_image_order_and_ratio_follow(scripted):
    """image1..image10 in input order (gaps allowed), any sizes; ratio_follow picks the shape kept."""
    eng = scripted('ok</think>{"rewritten_prompt": "x", "wh_ratio": "1:1", "ratio_follow": "<image2>"}')
    clip = FakeCLIP()
    bridge.set_clip_info(clip, vision=True)
    wide, tall = torch.full((1, 32, 64, 3), 0.25), torch.full((1, 96, 32, 3), 0.75)
    out = run_pe(clip, preset="edit", prompt="put <image1> into <image2>", image1=wide, image3=tall)
    assert clip.tokenizer.texts[-1].count("<|image_pad|>") == 2
    sent = [float(t[0]["data"].reshape(-1)[0]) for t in clip.last_tokens if isinstance(t[0], dict)]
    assert sent == [0.25, 0.75]  # image1 first, then the next connected input
    _, _, ratio, follow, width, height, _ = out
    assert (ratio, follow) == ("1:1", "<image2>")
    assert abs(width / height - 32 / 96) < 0.05  # the second image's shape, not wh_ratio
    with pytest.raises(ValueError, match="at most 10 images"):
        run_pe(clip, preset="edit", image1=torch.zeros(11, 16, 16, 3))
    with pytest.raises(ValueError, match="<image3>"):
        run_pe(clip, preset="edit", prompt="use <image3>", image1=wide)
    assert len(eng.calls) == 1


def test_enhancer_system_prompt_official_or_own(scripted, tmp_path, monkeypatch):
    from qwen35_fast.downloads import model_fetch

    scripted('{"rewritten_prompt": "x", "wh_ratio": "1:1"}')
    monkeypatch.setattr(prompt_enhancer, "_models_dir", lambda: str(tmp_path))
    for preset in ("text-to-image", "edit"):  # what an earlier download left in the models folder
        path = model_fetch.prompt_path(preset, str(tmp_path))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(f"OFFICIAL {preset} PROMPT\n", encoding="utf-8")
    clip = FakeCLIP()
    run_pe(clip, system_prompt="official")
    assert clip.tokenizer.texts[-1].startswith("<|im_start|>system\nOFFICIAL text-to-image PROMPT<|im_end|>")
    run_pe(clip, system_prompt="official", preset="edit")
    assert clip.tokenizer.texts[-1].startswith("<|im_start|>system\nOFFICIAL edit PROMPT<|im_end|>")
    run_pe(clip, system_prompt="My own rules.")
    assert clip.tokenizer.texts[-1].startswith("<|im_start|>system\nMy own rules.<|im_end|>")
    for preset in ("text-to-image", "edit"):
        with pytest.raises(ValueError, match="system prompt is empty.*'official'"):
            run_pe(clip, system_prompt="  ", preset=preset)
    run_pe(clip, system_prompt="", preset="custom", temperature=1.0, top_k=20, top_p=0.95, min_p=0.0,
           presence_penalty=0.0)
    assert clip.tokenizer.texts[-1].startswith("<|im_start|>user\n")
    with pytest.raises(ValueError, match="'official' needs preset"):
        run_pe(clip, system_prompt="official", preset="custom")


@pytest.mark.parametrize("kw, match", [
    (dict(prompt="   "), "prompt is empty"),
    (dict(max_length=0), "max_length must be between"),
    (dict(max_length=10**6), "max_length must be between"),
    (dict(preset="nope"), "unknown preset"),
    (dict(megapixels=float("nan")), "megapixels must be a number in"),  # NaN passes ComfyUI's min/max check
    (dict(megapixels=float("inf")), "megapixels must be a number in"),
    (dict(image1=torch.zeros(1, 0, 8, 3)), "input image is empty"),
])
def test_enhancer_bad_input(scripted, kw, match):
    eng = scripted("x")
    clip = FakeCLIP()
    with pytest.raises(ValueError, match=match):
        run_pe(clip, **kw)
    assert eng.calls == [] and clip.patcher.object_patches == {}


def test_enhancer_refuses_images_without_vision_weights(scripted, tmp_path):
    from safetensors.torch import save_file

    eng = scripted("x")
    path = tmp_path / "qwen_text_only.safetensors"
    save_file({mtp_graft.QWEN35_MARKER: torch.zeros(2)}, str(path))
    clip = FakeCLIP(paths=[str(path)])  # a core-loaded CLIP: the file header tells
    with pytest.raises(ValueError, match="no vision weights"):
        run_pe(clip, image1=torch.zeros(1, 32, 32, 3))
    save_file({mtp_graft.QWEN35_MARKER: torch.zeros(2), "model.visual.blocks.0.norm1.weight": torch.zeros(2)},
              str(path))
    run_pe(clip, image1=torch.zeros(1, 32, 32, 3))
    assert len(eng.calls) == 1


def test_enhancer_refuses_non_qwen_clip(scripted):
    with pytest.raises(ValueError, match="not Qwen3.5"):
        run_pe(FakeCLIP(qwen=False))


# ---------------------------------------------------------------------------------------------
# loader


@pytest.fixture
def te_folder(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    folder_paths.FOLDERS["text_encoders"] = str(tmp_path)
    save_file({mtp_graft.QWEN35_MARKER: torch.zeros(2)}, str(tmp_path / "qwen.safetensors"))
    save_file({mtp_graft.QWEN35_MARKER: torch.zeros(2), "mtp.fc.weight": torch.ones(2, 4)},
              str(tmp_path / "qwen_with_mtp.safetensors"))
    save_file({"mtp.fc.weight": torch.ones(2, 4), "mtp.norm.weight": torch.ones(2)}, str(tmp_path / "head.safetensors"))
    save_file({"text_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(2)}, str(tmp_path / "clip_l.safetensors"))
    comfy.sd.CALLS.clear()
    comfy.sd.LOADER = lambda paths, clip_type, opts: FakeCLIP(paths=paths)
    grafts = []

    def fake_build(tensors, config, *, dtype, device):
        grafts.append(sorted(tensors))
        if tensors["mtp.fc.weight"].shape[1] != 4:
            raise Qwen35Error("mtp.fc.weight has shape [2, 3], expected [2, 4]")
        return torch.nn.Linear(4, 2)

    monkeypatch.setattr(mtp_graft, "build_mtp_head", fake_build)
    monkeypatch.setattr(mtp_graft, "_engine_config", lambda target: "config")
    yield tmp_path, grafts
    comfy.sd.LOADER = None


def test_loader_refuses_non_qwen_file_before_loading(te_folder):
    with pytest.raises(ValueError, match="not a Qwen3.5 checkpoint"):
        Qwen35CLIPLoader.execute("clip_l.safetensors", "none")
    assert comfy.sd.CALLS == []


def test_loader_without_mtp_says_mtp_is_off(te_folder):
    out = Qwen35CLIPLoader.execute("qwen.safetensors", "none")
    clip, status = out.args
    assert status.split("\n")[0] == "MTP off: no head. Pick mtp_head 'download (base model of the same size)'."
    assert "MTP is off" in status and out.ui == {"text": [status]}
    assert comfy.sd.CALLS[0][1] == comfy.sd.CLIPType.QWEN_IMAGE
    assert bridge.clip_info(clip) == {"vision": False, "mtp": False, "source": "qwen.safetensors"}
    assert not hasattr(clip.cond_stage_model.qwen35_test.transformer.model, "mtp")


def test_loader_grafts_mtp_from_main_file_or_second_file(te_folder):
    _, grafts = te_folder
    clip, status = Qwen35CLIPLoader.execute("qwen_with_mtp.safetensors", "none").args
    assert grafts == [["mtp.fc.weight"]] and "MTP head from qwen_with_mtp.safetensors" in status
    assert status.split("\n")[:2] == ["MTP on: head qwen_with_mtp", "Loaded qwen_with_mtp"]
    assert isinstance(clip.cond_stage_model.qwen35_test.transformer.model.mtp, torch.nn.Linear)
    clip, status = Qwen35CLIPLoader.execute("qwen.safetensors", "head.safetensors").args
    assert grafts[-1] == ["mtp.fc.weight", "mtp.norm.weight"] and bridge.clip_info(clip)["mtp"] is True


def test_loader_rejects_head_without_mtp_or_wrong_shape(te_folder):
    tmp, _ = te_folder
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="has no mtp"):
        Qwen35CLIPLoader.execute("qwen.safetensors", "clip_l.safetensors")
    save_file({"mtp.fc.weight": torch.ones(2, 3)}, str(tmp / "bad_head.safetensors"))
    with pytest.raises(ValueError, match="does not fit"):
        Qwen35CLIPLoader.execute("qwen.safetensors", "bad_head.safetensors")
    (tmp / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="Cannot read"):
        Qwen35CLIPLoader.execute("broken.safetensors", "none")


def test_loader_offers_missing_enhancer_files_and_downloads_them(te_folder, monkeypatch, tmp_path):
    """A Comfy-Org enhancer file not on disk is listed by name and fetched with a progress bar when run."""
    from huggingface_hub import constants
    from qwen35_fast.downloads import model_fetch
    from safetensors.torch import save

    from tests.hub_server import FakeHub

    name = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"
    options = {i.id: i for i in Qwen35CLIPLoader.define_schema().inputs}
    assert name in options["clip_name"].options and "qwen.safetensors" in options["clip_name"].options
    assert options["mtp_head"].default == model_fetch.DOWNLOAD_MATCHING
    assert "download (Qwen/Qwen3.5-9B)" in options["mtp_head"].options
    # files are offered as heads only when their header has mtp.* tensors
    files = [o for o in options["mtp_head"].options if not model_fetch.is_download(o) and o != "none"]
    assert sorted(files) == ["head.safetensors", "qwen_with_mtp.safetensors"], files
    data = save({mtp_graft.QWEN35_MARKER: torch.zeros(2), "pad": torch.zeros(600_000)})  # a few MiB
    hub = FakeHub().start()
    try:
        hub.add_repo(model_fetch.PE_REPO, {f"text_encoders/{name}": data})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        comfy.utils.UPDATES.clear()
        clip, status = Qwen35CLIPLoader.execute(name, "none").args
    finally:
        hub.stop()
    folder, _ = te_folder
    assert (folder / name).read_bytes() == data and "MTP is off" in status
    assert comfy.utils.UPDATES and comfy.utils.UPDATES[-1][0] == comfy.utils.UPDATES[-1][1] >= 2  # MiB bar, full
    # the head download choice reads the size from the main file and refuses what it cannot place
    with pytest.raises(model_fetch.FetchError, match="cannot tell the Qwen3.5 size"):
        Qwen35CLIPLoader.execute("qwen.safetensors", "download (Qwen/Qwen3.5-9B)")


# ---------------------------------------------------------------------------------------------
# status that fits on the node; a suspect head


PE_NAME = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"


def test_the_loader_status_puts_mtp_first_in_short_lines(te_folder):
    """The two lines the node shows first fit its width (long file names shortened, their telling parts
    kept), MTP's state before the file name."""
    from safetensors.torch import save_file

    folder, _ = te_folder
    save_file({mtp_graft.QWEN35_MARKER: torch.zeros(2), "mtp.fc.weight": torch.ones(2, 4)}, str(folder / PE_NAME))
    exec_utils.NODE_ID = "3"
    server.PromptServer.instance.texts.clear()
    try:
        _, status = Qwen35CLIPLoader.execute(PE_NAME, "none").args
    finally:
        exec_utils.NODE_ID = None
    assert server.PromptServer.instance.texts[-1] == ("3", status)
    first, second = status.split("\n")[:2]
    assert first.startswith("MTP on: head ") and second.startswith("Loaded ")
    for line in (first, second):
        assert len(line) <= 50 and "pe_t2i" in line and "int8_convrot" in line and "qwen3.5_9b" in line, line


class _HeadStats(SimpleNamespace):
    """Stats of a run at depth 2 with ``accepted`` of ``drafted`` drafts kept."""

    def __init__(self, drafted, accepted):
        super().__init__(tokens=40, steps=30, drafted=drafted, accepted=accepted,
                         acceptance_rate=accepted / drafted if drafted else 0.0, prefill_s=0.01, decode_s=0.1,
                         tok_per_s=10.0, mtp_depth=2, attention_backend="torch",
                         mtp_acceptance=[accepted / drafted if drafted else None])


def _with_stats(eng, drafted, accepted):
    def run(module, embeds, **kw):
        res = eng(module, embeds, **kw)
        res.stats = _HeadStats(drafted, accepted)
        return res
    return run


def test_the_head_download_choice_is_recorded_a_chosen_file_is_not(te_folder, monkeypatch):
    from qwen35_fast.downloads import model_fetch

    folder, _ = te_folder
    fetched = str(folder / "head.safetensors")
    monkeypatch.setattr(model_fetch, "mtp_head_for", lambda choice, clip_path, dest, **kw: fetched)
    clip, _ = Qwen35CLIPLoader.execute("qwen.safetensors", model_fetch.DOWNLOAD_MATCHING).args
    assert bridge.clip_info(clip)["fetched_head"] == fetched
    clip, _ = Qwen35CLIPLoader.execute("qwen.safetensors", "head.safetensors").args
    assert "fetched_head" not in bridge.clip_info(clip)


@pytest.mark.parametrize("case", ["fetched, never accepted", "supplied", "fetched, accepted", "too few drafts"])
def test_a_fetched_head_whose_drafts_are_never_accepted_is_named_once(scripted, monkeypatch, caplog, tmp_path,
                                                                      case):
    """Near-zero acceptance on a head fetched by range reads: the enhancer node's FIRST line (and one log
    warning) says the head may be wrong and how to fetch it anew (delete the named file, run again); the
    next run says nothing more. A head the user supplied, accepted drafts or too few drafts: no note."""
    head = tmp_path / "text_encoders" / "qwen3.5_9b_mtp_head.safetensors"
    head.parent.mkdir()
    head.write_bytes(b"head")
    drafted, accepted = {"too few drafts": (4, 0), "fetched, accepted": (40, 24)}.get(case, (40, 1))
    monkeypatch.setattr(bridge, "generate", _with_stats(scripted(ANSWER), drafted, accepted))
    clip = FakeCLIP()
    if case != "supplied":
        bridge.set_clip_info(clip, fetched_head=str(head))
    exec_utils.NODE_ID = "7"
    shown = []
    with caplog.at_level("WARNING"):
        for _ in range(2):
            run_pe(clip)
            shown.append(server.PromptServer.instance.texts[-1][1].split("\n")[0])
    warned = [r.getMessage() for r in caplog.records if "MTP head may be wrong" in r.getMessage()]
    if case != "fetched, never accepted":
        assert not warned and all(line.startswith("40 tokens") for line in shown), shown
        return
    assert len(warned) == 1
    assert shown[0].startswith("MTP head may be wrong (2% of drafts kept)"), shown
    assert "delete qwen3.5_9b_mtp_head.safetensors from text_encoders and run again" in shown[0]
    assert shown[1].startswith("40 tokens"), shown  # said once


def test_the_4bit_node_shows_what_to_do_first_under_itself(te_folder, monkeypatch):
    """The converter's node says first, in one short line, which file it wrote and to compare answers
    (4 bits may change them); its summary follows."""
    from qwen35_fast.nodes.convert_node import Qwen35Save4bit
    from qwen35_fast.patches import convert_4bit

    folder, _ = te_folder
    written = folder / "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.convrot_w4a4.safetensors"
    monkeypatch.setattr(convert_4bit, "plan", lambda source, fmt: [])
    monkeypatch.setattr(convert_4bit, "convert", lambda *a, **k: written)
    monkeypatch.setattr(convert_4bit, "summary", lambda out, steps, errors: f"wrote {out.name}: 0 projections")
    exec_utils.NODE_ID = "11"
    try:
        (status,) = Qwen35Save4bit.execute("qwen.safetensors", "convrot_w4a4").args
    finally:
        exec_utils.NODE_ID = None
    assert server.PromptServer.instance.texts[-1] == ("11", status)
    first, rest = status.split("\n", 1)
    assert first.startswith("Wrote qwen3.5_9b") and "convrot_w4a4" in first and "compare" in first
    assert len(first) <= 80 and rest == f"wrote {written.name}: 0 projections"
