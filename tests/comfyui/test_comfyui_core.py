"""Opt-in: the pack on a random Qwen3.5 0.8B checkpoint loaded by core ``comfy.sd.load_clip`` (in process, CPU).

Set ``QWEN35_FAST_COMFYUI=<ComfyUI tree>`` and run with ComfyUI's Python (``scripts/test_comfyui.sh``
does both for every tree it builds). Checkpoints (bf16 and int8_convrot, each with and without
``mtp.*``) are built once into ``QWEN35_FAST_CACHE``; the int8 files are written the way ComfyUI's
own save path writes them (per layer a ``<layer>.comfy_quant`` JSON uint8 tensor, int8 ``weight``,
float32 ``weight_scale``), quantized by comfy-kitchen.

Per file: greedy tokens through the patch equal core's own ``generate`` and the argmax of a
cache-free forward of the same modules (int8: up to near-ties, see ``_assert_cache_free_agrees``);
with ``mtp.*`` the engine drafts with core's own head where core built one (never a second head).
Cancel mid-generation, then the next prompt runs.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tests.comfyui import test_comfyui_integration as files
from tests.oracles.comfy_tree import import_comfyui, int8_convrot

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI tree> to run")]

CACHE = Path(os.environ.get("QWEN35_FAST_CACHE", Path.home() / ".cache" / "qwen35_fast_comfyui"))
PROMPT = "Describe a red fox in the snow."
STEPS = 3
INT8_CONF = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}


# ---------------------------------------------------------------------------------------------
# ComfyUI and the checkpoints


@pytest.fixture(scope="module")
def comfy():
    return import_comfyui(COMFY)


def _tensors(kind: str) -> dict:
    t = files._text_tensors(torch, 1)
    if kind.endswith("_mtp"):
        t.update(files._mtp_tensors(torch, 5))
    return int8_convrot(t, INT8_CONF["convrot_groupsize"]) if kind.startswith("int8") else t


KINDS = ("bf16", "bf16_mtp", "int8", "int8_mtp")


def checkpoint(kind: str) -> str:
    """Path of the random 0.8B checkpoint ``kind`` (built on first use)."""
    from safetensors.torch import save_file

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"qwen35_08b_random_core_{kind}.safetensors"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # unique: two runs may build at once
        save_file(_tensors(kind), str(tmp))
        tmp.rename(path)
    return str(path)


def head_file() -> str:
    """A separate ``mtp.*`` file (another random head of the same size)."""
    from safetensors.torch import save_file

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / files.MTP_FILE
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # unique: two runs may build at once
        save_file(files._mtp_tensors(torch, 3), str(tmp))
        tmp.rename(path)
    return str(path)


def _core_load(comfy, path):
    return comfy.sd.load_clip(ckpt_paths=[path], clip_type=comfy.sd.CLIPType.QWEN_IMAGE)


def _core_has_mtp_loading(comfy) -> bool:
    """True on ComfyUI versions whose ``load_clip`` builds core's own MTP head (``Qwen35.mtp``)."""
    import inspect

    import comfy.text_encoders.qwen35 as q

    return "mtp" in inspect.signature(q.te).parameters


def _target(clip):
    from qwen35_fast.patches import comfy_bridge

    return comfy_bridge.find_qwen35(clip)


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()  # one 0.8B model in memory at a time


# ---------------------------------------------------------------------------------------------
# oracles


def _cache_free_logits(clip, tokens, generated):
    """Logits ``[len(generated), V]`` from ONE full forward (no cache) of core's own modules over the prompt
    plus ``generated``: row i scores the token at step i (teacher forcing)."""
    target = _target(clip)
    clip.load_model(tokens)
    device = clip.patcher.load_device
    clip.cond_stage_model.set_clip_options({"execution_device": device})
    rows = next(iter(tokens.values()))
    embeds = target.clip_model.process_tokens([[t[0] for t in r] for r in rows], device=device)[0]
    import comfy.model_management as mm

    dtype = torch.bfloat16 if mm.should_use_bf16(device) else torch.float32
    model = target.transformer.model
    with torch.no_grad():
        ids = torch.tensor([list(generated[:-1])], device=device, dtype=torch.long)
        x = torch.cat([embeds.to(dtype), model.embed_tokens(ids).to(dtype)], dim=1) if len(generated) > 1 else \
            embeds.to(dtype)
        h = model.forward(None, embeds=x, attention_mask=None)[0]
        n = len(generated)
        out = torch.cat([target.transformer.logits(h[:, : h.shape[1] - n + 1 + i]) for i in range(n)], dim=1)
    clip.cond_stage_model.reset_clip_options()
    return out[0].float()


def _assert_cache_free_agrees(logits, tokens, exact: bool):
    """Each token is the cache-free argmax. ``exact=False`` (int8 files, whose activation-quantized products
    depend on how many rows are multiplied at once in some versions): a different argmax is accepted
    only as a near-tie, the chosen token within 1% of the logit range of the top."""
    top = logits.max(-1)
    picked = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    gaps = (top.values - picked).tolist()
    span = (top.values - logits.min(-1).values).tolist()
    print(f"cache-free argmax {top.indices.tolist()}, gaps to the chosen tokens {[f'{g:.4f}' for g in gaps]}")
    for i, (g, r) in enumerate(zip(gaps, span)):
        if exact:
            assert top.indices[i].item() == tokens[i], (i, tokens, top.indices.tolist())
        else:
            assert g <= 0.01 * r, (i, g, r)


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.kitchen) if k.startswith("int8") else k
                                  for k in KINDS])
def test_load_patch_greedy_mtp(comfy, kind):
    """One load per file: greedy through the patch equals core's ``generate`` and a cache-free forward;
    with ``mtp.*`` the pack's loader keeps one head (core's where core built it) and MTP drafts with it."""
    from qwen35_fast.engine import bind
    from qwen35_fast.patches.clip_loader import load_qwen35_clip
    from qwen35_fast.patches.clip_patch import patch_clip

    with_mtp = kind.endswith("_mtp")
    if with_mtp:
        result = load_qwen35_clip(checkpoint(kind))
        clip = result.clip
        assert result.mtp
        target = _target(clip)
        core_head, grafted = getattr(target.transformer, "mtp", None), getattr(target.model, "mtp", None)
        if _core_has_mtp_loading(comfy):
            assert (core_head is not None, grafted is None) == (True, True), "two MTP heads in memory"
            assert bind(target.transformer).mtp is core_head
        else:
            assert core_head is None and grafted is not None
        # ComfyUI plans its VRAM with the model's size: the head the pack grafted is counted in it
        assert clip.patcher.model_size() == comfy.model_management.module_size(clip.patcher.model)
        from qwen35_fast.patches.swap_patcher import SwapMixin

        assert isinstance(clip.patcher, SwapMixin) and isinstance(clip.patcher.clone(), SwapMixin)
    else:
        clip = _core_load(comfy, checkpoint(kind))
    tokens = clip.tokenize(PROMPT)
    core = list(clip.generate(tokens, do_sample=False, max_length=STEPS))
    logits = _cache_free_logits(clip, tokens, core)
    patched = patch_clip(clip, mtp=3 if with_mtp else "off")
    ours = patched.generate(tokens, do_sample=False, max_length=STEPS)
    print(f"{kind}: core {core}, engine {list(ours)} ({ours.stats.accepted}/{ours.stats.drafted} drafts accepted)")
    assert list(ours) == core
    _assert_cache_free_agrees(logits, core, exact=not kind.startswith("int8"))
    if with_mtp:
        assert ours.stats.drafted > 0
    assert not [k for k in clip.patcher.object_patches if "generate" in k], "the input CLIP was patched"


@pytest.mark.one_tree
def test_auto_equals_mtp_off_through_the_loader(comfy, monkeypatch):
    """Greedy on the random 0.8B with its head, loaded by the pack's loader through ``load_clip``:
    ``mtp="auto"`` (drafts kept up to position 6, then none: cycles, then a plain segment; stand-in
    costs, a cycle at depth k costing 1 + 0.2 k plain steps) gives MTP off's tokens (depth 3:
    ``test_load_patch_greedy_mtp``; every fixed depth on ComfyUI's modules: ``test_engine_mtp``).
    Short: each multi-row step of this model costs about a second on two CPU cores."""
    import qwen35_fast.engine.generation as generation
    from qwen35_fast.engine import bind
    from qwen35_fast.patches import comfy_bridge as bridge
    from qwen35_fast.patches.clip_loader import load_qwen35_clip

    from tests.engine.test_mtp_auto import StandIn

    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(0.2))
    clip = load_qwen35_clip(checkpoint("bf16_mtp")).clip
    target = _target(clip)
    embeds, _ = bridge.prompt_embeds(target, clip.tokenize(PROMPT), torch.device("cpu"))
    greedy = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0,
                  presence_penalty=0.0, stop_tokens=[], execution_dtype=torch.float32)
    n = 30
    off = list(bridge.run_engine(target, embeds, max_length=n, mtp="off", **greedy))
    vocab = bind(target.transformer).config.vocab_size

    def phased(pos: int) -> int:
        right = pos < 6 or pos >= 24
        return off[pos] if right and pos < len(off) else (off[min(pos, n - 1)] + 1) % vocab

    got = bridge.run_engine(target, embeds, max_length=n, mtp="auto", mtp_draft=phased, **greedy)
    assert list(got) == off
    depths = got.stats.mtp_depths
    assert 0 in depths and max(depths) >= 2, depths


def test_chosen_head_file_replaces_cores_head(comfy):
    from qwen35_fast.patches.clip_loader import load_qwen35_clip
    from safetensors.torch import load_file

    result = load_qwen35_clip(checkpoint("bf16_mtp"), head_file())
    target = _target(result.clip)
    core_head = getattr(target.transformer, "mtp", None)
    grafted = getattr(target.model, "mtp", None)
    want = load_file(head_file())["mtp.fc.weight"]
    if _core_has_mtp_loading(comfy):
        assert (core_head is not None, grafted is None) == (True, True), "two MTP heads in memory"
        head = core_head
    else:
        assert core_head is None
        head = grafted
    assert torch.equal(head.fc.weight.to(want.dtype).cpu(), want), "the chosen head file was not used"
    tokens = result.clip.tokenize(PROMPT)
    assert len(result.clip.generate(tokens, do_sample=False, max_length=2)) == 2  # core runs with that head


def test_interrupt_then_next_prompt(comfy):
    import comfy.model_management as mm
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = _core_load(comfy, checkpoint("bf16"))
    patched = patch_clip(clip, mtp="off")
    tokens = patched.tokenize(PROMPT)
    mm.interrupt_current_processing(True)  # Cancel pressed: the engine stops at its next step
    with pytest.raises(mm.InterruptProcessingException):
        patched.generate(tokens, do_sample=False, max_length=200)
    assert not mm.processing_interrupted()
    again = patched.generate(tokens, do_sample=False, max_length=2)
    assert len(again) == 2 and again.stats is not None


def _streamed(monkeypatch, clip):
    """Make ``clip``'s patcher report DynamicVRAM (``ModelPatcherDynamic`` needs a GPU and comfy-aimdo;
    on the CPU every other part of the path below is ComfyUI's own) and count the reloads its
    ``cached_patcher_init`` (set by core ``load_clip``) serves."""
    init = clip.patcher.cached_patcher_init
    reloads = []

    def factory(*args, **kwargs):
        reloads.append(kwargs)
        return init[0](*args, **kwargs)

    monkeypatch.setattr(clip.patcher, "cached_patcher_init", (factory, *init[1:]))
    monkeypatch.setattr(clip.patcher, "is_dynamic", lambda: True)
    return reloads


def test_dynamic_clip_is_patched_over_one_resident_reload(comfy, monkeypatch):
    """A DynamicVRAM CLIP loaded by core ``load_clip`` is patched over ComfyUI's own reload of it without
    DynamicVRAM (``ModelPatcher.clone(disable_dynamic=True)``), made once: the patched CLIP's modules are
    the reload's, its patcher classic, its greedy tokens core's; a second patch (the enhancer patches
    per prompt) reuses the same weights."""
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = _core_load(comfy, checkpoint("bf16"))
    tokens = clip.tokenize(PROMPT)
    core = list(clip.generate(tokens, do_sample=False, max_length=STEPS))
    reloads = _streamed(monkeypatch, clip)
    patched = patch_clip(clip, mtp="off")
    assert reloads == [{"disable_dynamic": True}]
    resident = patched.cond_stage_model
    assert resident is patched.patcher.model and resident is not clip.cond_stage_model
    assert not patched.patcher.is_dynamic()
    assert list(patched.generate(tokens, do_sample=False, max_length=STEPS)) == core
    again = patch_clip(clip, mtp="off")
    assert reloads == [{"disable_dynamic": True}] and again.cond_stage_model is resident
    assert list(again.generate(tokens, do_sample=False, max_length=STEPS)) == core
    assert not [k for k in clip.patcher.object_patches if "generate" in k], "the input CLIP was patched"


def test_dynamic_clip_too_big_stays_streamed_and_says_why(comfy, monkeypatch, caplog):
    import logging

    import comfy.model_management as mm
    from qwen35_fast.patches.clip_patch import patch_clip

    clip = _core_load(comfy, checkpoint("bf16"))
    tokens = clip.tokenize(PROMPT)
    core = list(clip.generate(tokens, do_sample=False, max_length=STEPS))
    reloads = _streamed(monkeypatch, clip)
    monkeypatch.setattr(mm, "get_total_memory", lambda *a, **k: clip.patcher.model_size())
    patched = patch_clip(clip, mtp="off")
    assert reloads == [] and patched.cond_stage_model is clip.cond_stage_model
    caplog.set_level(logging.INFO)
    assert list(patched.generate(tokens, do_sample=False, max_length=STEPS)) == core
    why = [r.getMessage() for r in caplog.records if "DynamicVRAM" in r.getMessage()]
    assert why and "does not fit whole on this GPU" in why[0], why


def test_kept_stack_follows_comfys_unload(comfy):
    """The engine keeps a generation's decode stack for the next one (``engine/held.py``); ComfyUI's
    unload of the model (``unload_all_models`` -> ``detach``) frees it through the pack's detach
    callback, and the next prompt builds a new one with the same tokens."""
    import comfy.model_management as mm
    from qwen35_fast.engine import bind, held
    from qwen35_fast.patches.clip_patch import patch_clip

    held.release_all()
    clip = _core_load(comfy, checkpoint("int8"))
    patched = patch_clip(clip, mtp="off")
    tokens = patched.tokenize(PROMPT)
    first = patched.generate(tokens, do_sample=False, max_length=STEPS)
    again = patched.generate(tokens, do_sample=False, max_length=STEPS)
    assert "kept from the last generation" in again.stats.decode_path and list(again) == list(first)
    assert [r.binding.transformer for r in held.kept_stacks()] == [bind(_target(clip).transformer).transformer]
    mm.unload_all_models()
    assert held.kept_stacks() == []
    after = patched.generate(tokens, do_sample=False, max_length=STEPS)
    assert "kept" not in after.stats.decode_path and list(after) == list(first)
    held.release_all()


def test_the_enhancers_thinking_budget_on_comfyuis_tokenizer(comfy):
    """ComfyUI's own Qwen3.5 tokenizer writes "\\n</think>\\n\\n" as three ids around the </think> token, and
    the enhancer with thinking_budget 3 (greedy through the custom preset, the random 0.8B, which never
    closes its thinking itself) gives its first 3 tokens, that close, then the answer: thinking_tokens 4
    (the close's newline is still inside the block), cut by the budget; the text the enhancer parses has
    the block closed where the budget closed it."""
    from qwen35_fast.enhancer import prompt_enhancer as pe

    clip = _core_load(comfy, checkpoint("bf16"))
    close = pe.text_ids(clip, pe.THINK_CLOSE)
    assert len(close) == 3 and close[1] == 248069 and clip.decode(close, skip_special_tokens=False) == pe.THINK_CLOSE
    greedy = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, presence_penalty=0.0)
    kw = dict(system_prompt="SYS", preset="custom", custom=greedy, max_length=9, seed=1, mtp="off")
    free = pe.enhance(clip, PROMPT, **kw)
    assert "</think>" not in free.text and free.stats.thinking_tokens is None
    cut = pe.enhance(clip, PROMPT, thinking_budget=3, **kw)
    assert (cut.stats.thinking_tokens, cut.stats.thinking_cut, cut.stats.tokens) == (4, True, 9)
    head, _, tail = cut.text.partition(pe.THINK_CLOSE)
    assert free.text.startswith(head) and head != free.text and tail, cut.text
