"""Prompt-enhancer answers: thinking split, answer parsing (valid and broken), sizes.

The answers below are written by hand in the shapes the enhancer produces (and breaks).
"""

from __future__ import annotations

import json
import math
import random

import pytest
from qwen35_fast.enhancer.enhancer_answer import (
    PEResult,
    parse_answer,
    parse_ratio,
    size_for_ratio,
    split_thinking,
)


@pytest.fixture
def py_rng(test_seed):
    """A ``random.Random`` seeded with the test seed (printed on failure)."""
    return random.Random(test_seed)


# ------------------------------------------------------------------------------------------
# split_thinking
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,thinking,answer", [
    # The prompt ends with <think>: the output starts inside the block.
    ("The user wants a cat.\nLet me plan.\n</think>\n\nHere it is: {}", "The user wants a cat.\nLet me plan.",
     "Here it is: {}"),
    ("<think>\nplan\n</think>\nanswer<|im_end|>", "plan", "answer"),
    ("  <think>plan</think>answer <|im_end|><|endoftext|> ", "plan", "answer"),
    ("</think>\n\nanswer only", "", "answer only"),                 # empty thinking
    ("<think>\nstill thinking when the budget ran out", "still thinking when the budget ran out", ""),
    ("no tags at all {\"rewritten_prompt\": \"x\"}", "", "no tags at all {\"rewritten_prompt\": \"x\"}"),
    ("a</think>b</think>c", "a", "b</think>c"),                     # the first close tag ends thinking
    ("思考：用户想要一只猫。</think>回答", "思考：用户想要一只猫。", "回答"),
    ("", "", ""),
])
def test_split_thinking(text, thinking, answer):
    assert split_thinking(text) == (thinking, answer)


def test_split_thinking_rejects_non_text():
    with pytest.raises(ValueError, match="must be a str"):
        split_thinking(None)


# ------------------------------------------------------------------------------------------
# parse_answer: realistic and broken answers
# ------------------------------------------------------------------------------------------

CAT = "A ginger cat asleep on a sunlit windowsill, soft morning light, shallow depth of field."

CASES = {
    "plain json": (
        '{"rewritten_prompt": "%s", "wh_ratio": "4:3"}' % CAT,
        CAT, "4:3", None),
    "fenced with prose around": (
        "Sure! Here is the enhanced prompt.\n\n```json\n{\n  \"rewritten_prompt\": \"%s\",\n"
        "  \"wh_ratio\": \"16:9\",\n  \"ratio_follow\": true\n}\n```\n\nLet me know if you want changes." % CAT,
        CAT, "16:9", True),
    "misspelled key": (
        '```json\n{"rewrited_prompt": "%s", "wh_ratio": "9:16", "ratio_follow": "yes"}\n```' % CAT,
        CAT, "9:16", "yes"),
    "last object wins": (
        'Draft: {"rewritten_prompt": "a cat", "wh_ratio": "1:1"}\nFinal:\n'
        '{"rewritten_prompt": "%s", "wh_ratio": "3:2"}' % CAT,
        CAT, "3:2", None),
    "later object without the key is skipped": (
        '{"rewritten_prompt": "%s", "wh_ratio": "2:3"}\nNotes: {"style": "photo"}' % CAT,
        CAT, "2:3", None),
    "braces inside the prompt": (
        '{"rewritten_prompt": "A neon sign that reads {OPEN 24/7} above a diner door, rain.", '
        '"wh_ratio": "16:9"}',
        "A neon sign that reads {OPEN 24/7} above a diner door, rain.", "16:9", None),
    "escaped quotes": (
        r'{"rewritten_prompt": "A poster with the headline \"SUMMER SALE\" in bold red letters.", '
        r'"wh_ratio": "3:4"}',
        'A poster with the headline "SUMMER SALE" in bold red letters.', "3:4", None),
    "unicode and escapes": (
        '{"rewritten_prompt": "一只橘猫睡在洒满阳光的窗台上，柔和晨光。 Caf\\u00e9 sign \\ud83d\\ude00.", '
        '"wh_ratio": "1:1"}',
        "一只橘猫睡在洒满阳光的窗台上，柔和晨光。 Café sign 😀.", "1:1", None),
    "trailing commas": (
        '{\n  "rewritten_prompt": "%s",\n  "wh_ratio": "21:9",\n  "ratio_follow": false,\n}' % CAT,
        CAT, "21:9", False),
    "single quotes with an apostrophe": (
        "{'rewritten_prompt': 'A child's red kite over green hills, windy afternoon.', 'wh_ratio': '16:9'}",
        "A child's red kite over green hills, windy afternoon.", "16:9", None),
    "python literals": (
        "{'rewritten_prompt': 'A lighthouse at dusk.', 'wh_ratio': None, 'ratio_follow': False}",
        "A lighthouse at dusk.", None, False),
    "raw newlines inside the string": (
        '{"rewritten_prompt": "Line one of the scene.\nLine two: a red door.", "wh_ratio": "4:5"}',
        "Line one of the scene.\nLine two: a red door.", "4:5", None),
    "stray unescaped quotes": (
        '{"rewritten_prompt": "A shop sign saying "OPEN", then a bell over the door, "WELCOME" mat.", '
        '"wh_ratio": "3:2"}',
        'A shop sign saying "OPEN", then a bell over the door, "WELCOME" mat.', "3:2", None),
    "missing comma between members": (
        '{"rewritten_prompt": "%s" "wh_ratio": "16:9"}' % CAT,
        CAT, "16:9", None),
    "numeric ratio": (
        '{"rewritten_prompt": "%s", "wh_ratio": 1.5}' % CAT,
        CAT, "1.5", None),
    "nested under another key": (
        '{"result": {"rewritten_prompt": "%s", "wh_ratio": "1:1", "ratio_follow": "no"}}' % CAT,
        CAT, "1:1", "no"),
    "escapes in broken json": (
        "{'rewritten_prompt': 'Caf\\u00e9 \\ud83d\\ude00\\n\\t\\\\ \\'quoted\\' \\/', 'wh_ratio': '1:1', "
        "'ratio_follow': true,}",
        "Café 😀\n\t\\ 'quoted' /", "1:1", True),
    "unquoted keys": (
        '{rewritten_prompt: "%s", wh_ratio: "5:4"}' % CAT,
        CAT, "5:4", None),
    "prose with braces before the object": (
        "I kept the {subject} and {style} placeholders out. Final answer:\n"
        '{"rewritten_prompt": "%s", "wh_ratio": "1:1"}' % CAT,
        CAT, "1:1", None),
    "truncated inside the prompt": (
        '```json\n{"wh_ratio": "16:9", "rewritten_prompt": "A vast desert at golden hour, dunes rippling',
        "A vast desert at golden hour, dunes rippling", "16:9", None),
    "truncated after the prompt": (
        '{"rewritten_prompt": "%s", "wh_ra' % CAT,
        CAT, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_answer_cases(name):
    answer, prompt, ratio, follow = CASES[name]
    got = parse_answer(answer)
    assert isinstance(got, PEResult)
    assert got.parse_ok, name
    assert got.rewritten_prompt == prompt
    assert got.wh_ratio == ratio
    assert got.ratio_follow == follow
    assert got.raw == answer


def test_parse_answer_salvages_with_regex_when_no_object_parses():
    # An unquoted ratio (16:9 reads as 16 then a stray colon) breaks the object; the key survives.
    answer = '{"rewritten_prompt": "%s", "wh_ratio": 16:9}' % CAT
    got = parse_answer(answer)
    assert got.parse_ok and got.rewritten_prompt == CAT and got.wh_ratio == "16:9"
    # A stray ']' where a key should be.
    answer = 'Result: { ] "rewritten_prompt" : "%s", "wh_ratio": "3:4" }' % CAT
    got = parse_answer(answer)
    assert got.parse_ok and got.rewritten_prompt == CAT and got.wh_ratio == "3:4"
    # Key written as prose-ish assignment, truncated.
    got = parse_answer("rewritten_prompt = 'A foggy harbour with fishing boats")
    assert got.parse_ok and got.rewritten_prompt == "A foggy harbour with fishing boats"


@pytest.mark.parametrize("answer", [
    "A ginger cat asleep on a windowsill.",          # the model answered with plain text
    "  \n{\"wh_ratio\": \"16:9\"}\n ",                 # an object without the prompt key
    '{"rewritten_prompt": "   ", "wh_ratio": "1:1"}',  # an empty prompt
    "",
    "{{{{ ]]] ::: }}}",
])
def test_parse_answer_falls_back_to_raw(answer):
    got = parse_answer(answer)
    assert got == PEResult(answer.strip(), None, None, False, answer)


def test_parse_answer_round_trips_random_prompts(py_rng):
    # Prompts full of JSON-hostile characters, serialised by json.dumps (the independent encoder),
    # optionally wrapped in fences and prose.
    r = py_rng
    alphabet = 'abc XYZ{}[]:,"\'\\/\n\t猫é😀<>#`'
    for _ in range(300):
        prompt = "".join(r.choice(alphabet) for _ in range(r.randint(1, 60))).strip() or "x"
        obj = {"rewritten_prompt": prompt, "wh_ratio": r.choice(["16:9", "1:1", "9:16"])}
        if r.random() < 0.5:
            obj["ratio_follow"] = r.choice([True, False, "partial"])
        body = json.dumps(obj, ensure_ascii=r.random() < 0.5, indent=r.choice([None, 2]))
        answer = r.choice(["", "Here you go:\n", "思考完成。\n"]) + r.choice(["%s", "```json\n%s\n```"]) % body
        answer += r.choice(["", "\nHope this helps!", "\n{note: trailing prose}"])
        got = parse_answer(answer)
        assert got.parse_ok and got.rewritten_prompt == prompt.strip(), answer
        assert got.wh_ratio == obj["wh_ratio"] and got.ratio_follow == obj.get("ratio_follow")


def test_parse_answer_after_split_thinking():
    text = ("The user asks for a cat. I'll describe light, pose, and ratio {\"draft\": 1}.\n</think>\n\n"
            '```json\n{"rewritten_prompt": "%s", "wh_ratio": "4:3", "ratio_follow": false}\n```<|im_end|>' % CAT)
    thinking, answer = split_thinking(text)
    assert thinking.startswith("The user asks") and "draft" in thinking
    got = parse_answer(answer)
    assert (got.rewritten_prompt, got.wh_ratio, got.ratio_follow, got.parse_ok) == (CAT, "4:3", False, True)


def test_parse_answer_survives_deep_nesting_and_long_text():
    got = parse_answer("[" * 5000 + "{" * 5000 + "x")
    assert not got.parse_ok
    long_prompt = "word " * 20000
    got = parse_answer('{"rewritten_prompt": "%s", "wh_ratio": "1:1"}' % long_prompt)
    assert got.parse_ok and got.rewritten_prompt == long_prompt.strip()


def test_parse_answer_rejects_non_text():
    with pytest.raises(ValueError, match="must be a str"):
        parse_answer(b"{}")


# ------------------------------------------------------------------------------------------
# Sizes
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,ratio", [
    ("16:9", 16 / 9), ("16/9", 16 / 9), ("9:16", 9 / 16), ("1.78", 1.78), ("4 x 3", 4 / 3), ("3×2", 1.5),
    ("16：9", 16 / 9), ("2.39:1", 2.39), ("ratio 3:4 (portrait)", 0.75), (1.5, 1.5), (2, 2.0),
    (None, None), ("", None), ("square-ish", None), ("0:9", None), ("16:0", None), (float("nan"), None),
    (-1.0, None), (True, None),
])
def test_parse_ratio(text, ratio):
    got = parse_ratio(text)
    assert got == (pytest.approx(ratio) if ratio is not None else None)


def _within_rounding(w, h, ratio, megapixels, multiple):
    """Bounds implied by rounding each ideal side to the nearest multiple."""
    ideal_w = math.sqrt(megapixels * 1e6 * ratio)
    ideal_h = math.sqrt(megapixels * 1e6 / ratio)
    return (abs(w - ideal_w) <= multiple / 2 + 1e-9 or w == multiple) and \
           (abs(h - ideal_h) <= multiple / 2 + 1e-9 or h == multiple)


def test_size_for_ratio_random(py_rng):
    r = py_rng
    for _ in range(500):
        num, den = r.randint(1, 21), r.randint(1, 21)
        ratio = min(max(num / den, 1 / 8), 8)
        mp = r.uniform(0.25, 4.0)
        multiple = r.choice([8, 16, 32, 64])
        w, h = size_for_ratio(r.choice([f"{num}:{den}", f"{num}/{den}", num / den]), mp, multiple)
        assert w % multiple == 0 and h % multiple == 0 and w >= multiple and h >= multiple
        assert _within_rounding(w, h, ratio, mp, multiple), (num, den, mp, multiple, w, h)
        assert abs(w * h / (mp * 1e6) - 1) < 0.15


def test_size_for_ratio_examples():
    assert size_for_ratio("1:1", 1.0) == (1008, 1008)      # 1000 / 16 = 62.5 rounds up
    assert size_for_ratio("16:9", 1.0) == (1328, 752)
    assert size_for_ratio("9:16", 1.0) == (752, 1328)
    assert size_for_ratio(None, 1.0) == size_for_ratio("garbled", 1.0) == (1008, 1008)
    assert size_for_ratio("1:1", 1.048576, multiple=64) == (1024, 1024)
    assert size_for_ratio("100:1", 1.0) == size_for_ratio("8:1", 1.0)   # extreme ratios are clamped


@pytest.mark.parametrize("mp", [0.0, -1.0, 100.0, float("nan"), float("inf"), "1.0", None, True])
def test_size_for_ratio_rejects_bad_megapixels(mp):
    with pytest.raises(ValueError, match="megapixels must be a number in"):
        size_for_ratio("1:1", mp)


@pytest.mark.parametrize("multiple", [0, -16, 1.5, 1000])
def test_size_for_ratio_rejects_bad_multiple(multiple):
    with pytest.raises(ValueError, match="multiple must be an integer"):
        size_for_ratio("1:1", 1.0, multiple)
