"""RULER's needle-haystack and UUID variants (attngeom.kvcache.ruler): niah_single_3,
niah_multikey_2 and niah_multikey_3, against RULER's scripts/synthetic.yaml and niah.py."""

import random
import re

from attngeom.kvcache import ruler
from tiny_models import tiny_tokenizer

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


def _lines(example):
    preamble, haystack = example.context.split("\n", 1)
    assert preamble.startswith("A special magic")
    return haystack.split("\n")


def test_niah_multikey_2_hides_one_needle_among_needles():
    for ex in ruler.make_examples(tiny_tokenizer(), "niah_multikey_2", 1500, 3, seed=0):
        lines = _lines(ex)
        parsed = [NEEDLE.fullmatch(line) for line in lines]
        assert all(parsed) and len(lines) > 10                   # every line is a needle (RULER's "needle" haystack)
        keys = [m.group(2) for m in parsed]
        assert len(set(keys)) == len(keys)                       # the asked key occurs once
        (answer,) = ex.answers
        asked = re.search(r"for (\S+) mentioned", ex.question).group(1)
        assert [m.group(3) for m in parsed if m.group(2) == asked] == [answer]
        assert re.fullmatch(r"\d{7}", answer) and all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
        assert ex.max_new_tokens == 128 and ex.length > 1500 - ruler.tolerance(1500)


def test_niah_multikey_3_has_uuid_keys_and_values():
    (ex,) = ruler.make_examples(tiny_tokenizer(), "niah_multikey_3", 6000, 1, seed=1)
    parsed = [NEEDLE.fullmatch(line) for line in _lines(ex)]
    assert all(parsed) and all(m.group(1) == "uuids" for m in parsed)
    assert all(re.fullmatch(UUID, m.group(2)) and re.fullmatch(UUID, m.group(3)) for m in parsed)
    assert re.fullmatch(UUID, ex.answers[0]) and "special magic uuid for" in ex.question


def test_niah_single_3_asks_a_uuid():
    (ex,) = ruler.make_examples(tiny_tokenizer(), "niah_single_3", 800, 1, seed=0)
    assert re.fullmatch(UUID, ex.answers[0]) and f"is: {ex.answers[0]}." in ex.context


def test_a_larger_needle_haystack_only_adds_distractors():
    taken = {"x"}
    small = ruler.needle_haystack_text(5, ["N1", "N2"], random.Random(3), "words", "numbers", set(taken)).split("\n")
    large = ruler.needle_haystack_text(9, ["N1", "N2"], random.Random(3), "words", "numbers", set(taken)).split("\n")
    drop = [x for x in small if x.startswith("One")]
    assert drop == [x for x in large if x.startswith("One")][:5]  # the same first distractors, in order
    assert [x for x in small if x.startswith("N")] == ["N1", "N2"]
