"""RULER's essay haystack (attngeom.kvcache.ruler): each task's haystack is the one RULER's
scripts/synthetic.yaml gives it; the essay tasks draw theirs from the prose shipped in the package
(kvcache/data/prose.txt, with its licence beside it and in pyproject's package data), deterministic
by seed and sized in the tokenizer's tokens; ``haystack="noise"`` or a prose list overrides it."""

import re
import tomllib
from pathlib import Path

import pytest

from attngeom.kvcache import ruler
from tiny_models import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]

SYNTHETIC_YAML = {        # RULER's scripts/synthetic.yaml (NVIDIA/RULER c3f5e3b): task -> type_haystack
    "niah_single_1": "noise", "niah_single_2": "essay", "niah_single_3": "essay", "niah_multikey_1": "essay",
    "niah_multikey_2": "needle", "niah_multikey_3": "needle", "niah_multivalue": "essay",
    "niah_multiquery": "essay", "vt": "noise", "cwe": "none", "fwe": "none"}
OURS = {"niah_single_1": "niah_single", "niah_multikey_1": "niah_multikey", "vt": "variable_tracking",
        "cwe": "common_words", "fwe": "frequent_words"}
ESSAY_TASKS = [t for t, s in ruler.TASKS.items() if s.haystack == "essay"]
NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for \S+ is: \S+\.")


def test_each_task_has_rulers_haystack():
    assert {OURS.get(t, t): h for t, h in SYNTHETIC_YAML.items()} == {t: s.haystack for t, s in ruler.TASKS.items()}
    assert ESSAY_TASKS == ["niah_multikey", "niah_multivalue", "niah_multiquery", "niah_single_2", "niah_single_3"]


def test_the_prose_is_shipped_with_its_licence():
    text = ruler.ESSAY_FILE.read_bytes()
    assert ruler.ESSAY_FILE.parent == ROOT / "src" / "attngeom" / "kvcache" / "data"
    assert 250_000 < len(text) < 400_000 and len(ruler.essay_words()) > 40_000
    licence = (ruler.ESSAY_FILE.parent / "LICENSE").read_text(encoding="utf-8")
    assert "Attribution-ShareAlike 3.0" in licence and "Debian Administrator's Handbook" in licence
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attngeom"]
    assert {"kvcache/data/prose.txt", "kvcache/data/LICENSE"} <= set(data)
    # nothing in it a needle task asks about: no needle sentence, no 7-digit value, no UUID
    decoded = text.decode("utf-8")
    assert "special magic" not in decoded.lower() and not re.search(r"(?<!\d)\d{7}(?!\d)", decoded)


def _haystack_words(ex) -> list[str]:
    """The words of an example's haystack: the context past its preamble line, needles removed."""
    return NEEDLE.sub(" ", ex.context.split("\n", 1)[1]).split()


@pytest.mark.parametrize("task", ESSAY_TASKS)
def test_essay_tasks_draw_the_shipped_prose_deterministically_within_the_length(task):
    tok = tiny_tokenizer()
    examples = ruler.make_examples(tok, task, 1500, 2, seed=5)
    assert examples == ruler.make_examples(tok, task, 1500, 2, seed=5)                 # deterministic by seed
    other = ruler.make_examples(tok, task, 1500, 2, seed=6)
    essay = ruler.essay_words()
    for ex, ex6 in zip(examples, other):
        assert 1500 - ruler.tolerance(1500) <= ex.length <= 1500               # sized in tokens, as before
        assert ex.length == ruler.count_tokens(tok, ex.context + ex.question + ex.answer_prefix)
        words = _haystack_words(ex)
        assert len(words) > 100 and tuple(words) == essay[:len(words)]                # RULER: the essays' first words
        assert "The grass is green." not in ex.context
        assert ex.context != ex6.context and ex.answers != ex6.answers                 # the needles move with the seed
        for answer in ex.answers:
            assert ex.context.count(answer) == 1


def test_noise_and_prose_override_the_essays():
    tok = tiny_tokenizer()
    (noise,) = ruler.make_examples(tok, "niah_multivalue", 1000, 1, haystack="noise")
    assert "The grass is green." in noise.context and "Debian" not in noise.context
    (mine,) = ruler.make_examples(tok, "niah_multiquery", 1000, 1, haystack=["Alpha beta gamma. Delta epsilon."])
    assert set(_haystack_words(mine)) == {"Alpha", "beta", "gamma.", "Delta", "epsilon."}
    (single,) = ruler.make_examples(tok, "niah_single", 800, 1)                         # niah_single_1: noise
    assert "The grass is green." in single.context
    with pytest.raises(ValueError, match="'ruler', 'noise' or a list"):
        ruler.make_examples(tok, "niah_single", 800, 1, haystack="essays.txt")


def test_the_tables_say_which_haystack_a_run_used():
    from checks import load_script

    tables = load_script(ROOT / "tools" / "kvtasks_tables.py")
    said = {"noise": ", needle tasks in the noise",
            "ruler": ", RULER's haystacks (the essay tasks in the shipped essays)"}
    assert tables.haystack_said({"settings": {"haystack": "noise"}}) == said["noise"]
    assert tables.haystack_said({"settings": {"haystack": {"ruler": "essays", "essay_sha256": "0"}}}) == said["ruler"]
    assert tables.haystack_said({"settings": {"haystack": {"data": "/x/wiki.txt", "data_sha256": "0"}}}) == \
        ", needle tasks in wiki.txt"
    assert tables.haystack_said({"settings": {"data": "examples.jsonl"}}) == ""        # an examples file's run
