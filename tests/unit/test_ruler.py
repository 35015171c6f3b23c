"""RULER's synthetic tasks (attngeom.kvcache.ruler): lengths in a real subword tokenizer's tokens,
needles placed once, answers derivable from the context, determinism, the scorer, the
context/question split with and without a chat template, and the JSONL round trip."""

import re
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from attngeom.kvcache import ruler
from attngeom.kvcache.ruler import (TASKS, count_tokens, encode_example, make_examples, read_jsonl,
                                    string_match_all, string_match_part, tolerance, write_jsonl)

CORPUS = Path(__file__).parents[1] / "data" / "wikitext-2-raw-test-excerpt.txt"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

NIAH = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_single_2", "niah_single_3",
        "niah_multikey_2", "niah_multikey_3"]
LENGTHS = {**{t: (512, 1024) for t in NIAH}, "variable_tracking": (1024, 2048),
           "common_words": (1024, 4096), "frequent_words": (1024, 2048)}


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style pre-tokenizer, 1000 entries) trained here on the WikiText
    excerpt, the noise and the word lists; it adds a BOS token and has no chat template."""
    texts = [CORPUS.read_text(), ruler.NOISE * 20, " ".join(ruler.WORDS), " ".join(ruler.KEY_WORDS[::20])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|bos|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def prose():
    return [CORPUS.read_text()]


def _main_part(context: str, marker: str) -> str:
    """The context after the last occurrence of ``marker`` (past any solved example)."""
    return context[context.rindex(marker) + len(marker):]


# ---------------------------------------------------------------------------------------------
# registry and lengths
# ---------------------------------------------------------------------------------------------


def test_registry_follows_ruler():
    assert set(TASKS) == {*NIAH, "variable_tracking", "common_words", "frequent_words"}
    assert {t: s.max_new_tokens for t, s in TASKS.items()} == {
        **{t: 128 for t in NIAH}, "variable_tracking": 30, "common_words": 120, "frequent_words": 50}
    assert all(s.metric == "string_match_all" and s.name == t for t, s in TASKS.items())
    assert tolerance(256) == 16 and tolerance(4096) == 82


@pytest.mark.parametrize("task,length", [(t, n) for t, ns in LENGTHS.items() for n in ns])
def test_length_within_tolerance(tokenizer, task, length):
    examples = make_examples(tokenizer, task, length, 3)
    for i, ex in enumerate(examples):
        assert (ex.task, ex.index, ex.seed, ex.max_new_tokens) == (task, i, 0, TASKS[task].max_new_tokens)
        assert ex.length == count_tokens(tokenizer, ex.context + ex.question + ex.answer_prefix)
        assert length - tolerance(length) - TASKS[task].slack <= ex.length <= length
        assert ex.question.startswith("\n") and ex.answers


@pytest.mark.parametrize("task", ["niah_multivalue", "frequent_words"])
def test_example_numbers_do_not_depend_on_where_a_run_starts(tokenizer, task):
    """Examples 1 and 2 made from ``first=1`` are those a run from 0 makes: runs of ``--first-example``
    0, 10, 20 add up to one sample (tools/kvtasks_merge.py)."""
    assert make_examples(tokenizer, task, 512, 2, first=1) == make_examples(tokenizer, task, 512, 3)[1:]
    assert [e.index for e in make_examples(tokenizer, task, 512, 2, first=5)] == [5, 6]


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "variable_tracking"])
def test_prose_haystack_lengths(tokenizer, prose, task):
    for ex in make_examples(tokenizer, task, 1024, 2, haystack=prose):
        assert 1024 - tolerance(1024) <= ex.length <= 1024
        assert "Robert Boulter is an English film" in ex.context
        assert "The grass is green" not in ex.context


def test_too_short_and_unknown(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        make_examples(tokenizer, "common_words", 128, 1)
    with pytest.raises(ValueError, match="unknown task"):
        make_examples(tokenizer, "qa", 1024, 1)


# ---------------------------------------------------------------------------------------------
# needles and answers
# ---------------------------------------------------------------------------------------------

NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def _needles(ex):
    found = NEEDLE.findall(ex.context)
    for key, value in found:
        assert ex.context.count(f"for {key} is: {value}.") == 1
        assert ex.context.count(value) == 1
    return found


@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_niah_single_needle_once(tokenizer, prose, haystack):
    for ex in make_examples(tokenizer, "niah_single", 1024, 3, haystack="noise" if haystack == "noise" else prose):
        ((key, value),) = _needles(ex)
        assert ex.answers == (value,)
        assert f"for {key} mentioned" in ex.question and key in ex.answer_prefix
        assert ex.context.startswith("A special magic number is hidden") and ex.answer_prefix.endswith(" is")


def test_niah_multikey_distractors(tokenizer):
    for ex in make_examples(tokenizer, "niah_multikey", 1024, 3):
        needles = _needles(ex)
        keys = [k for k, _ in needles]
        assert len(needles) == 4 and len(set(keys)) == 4
        asked = [k for k in keys if f"for {k} mentioned" in ex.question]
        assert len(asked) == 1
        assert ex.answers == (dict(needles)[asked[0]],)
        assert all(k != asked[0] for k in keys if k not in asked)


def test_niah_multivalue_all_values(tokenizer):
    for ex in make_examples(tokenizer, "niah_multivalue", 1024, 3):
        needles = _needles(ex)
        assert len(needles) == 4 and len({k for k, _ in needles}) == 1
        assert sorted(ex.answers) == sorted(v for _, v in needles)
        assert ex.context.startswith("Some special magic numbers are hidden") and ex.answer_prefix.endswith(" are")


def test_niah_multiquery_keys_asked(tokenizer):
    for ex in make_examples(tokenizer, "niah_multiquery", 1024, 3):
        needles = dict(_needles(ex))
        assert len(needles) == 4
        asked = re.search(r"numbers for (.*) mentioned", ex.question).group(1).replace(", and ", ", ").split(", ")
        assert sorted(asked) == sorted(needles)
        assert list(ex.answers) == [needles[k] for k in asked]


def _vt_assigned(text: str, value: str) -> set[str]:
    """Variables of ``text`` whose chain of ``VAR X = ...`` assignments ends at ``value``."""
    direct = dict(re.findall(r"VAR ([A-Z]+) = (\d+)", text))
    alias = dict(re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", text))

    def resolve(v):
        while v in alias:
            v = alias[v]
        return direct.get(v)

    return {v for v in {*direct, *alias} if resolve(v) == value}


@pytest.mark.parametrize("options", [{}, {"num_chains": 2, "num_hops": 3}, {"haystack": "prose"}])
def test_variable_tracking_answers_derivable(tokenizer, prose, options):
    options = {**options, "haystack": prose} if "haystack" in options else options
    for ex in make_examples(tokenizer, "variable_tracking", 1024, 3, **options):
        value = re.search(r"assigned the value (\d{5}) in the text above", ex.question).group(1)
        main = _main_part(ex.context, "hidden in the following text.\n\n")
        assert _vt_assigned(main, value) == set(ex.answers)
        assert len(ex.answers) == options.get("num_hops", 4) + 1
        assert f"{len(ex.answers)} variables are assigned the value {value}" in ex.answer_prefix
        values = re.findall(r"VAR [A-Z]+ = (\d+)", main)
        assert len(values) == options.get("num_chains", 1) and len(set(values)) == len(values)
        # the solved example: its answer follows its own prefix
        shot = ex.context[:ex.context.rindex("Memorize and track")]
        assert shot.count("they are:  ") == 1


@pytest.mark.parametrize("length", [1024, 4096])
def test_common_words_are_most_frequent(tokenizer, length):
    for ex in make_examples(tokenizer, "common_words", length, 2):
        main = _main_part(ex.context, "Memorize the ones that appear most often.\n")
        entries = re.findall(r"(\d+)\. ([a-z-]+)", main)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(ex.answers) and len(ex.answers) == 10
        assert min(counts[w] for w in ex.answers) == (6 if length < 4096 else 30)
        assert max(c for w, c in counts.items() if w not in top) == (1 if length < 4096 else 3)


def test_frequent_words_are_most_frequent(tokenizer):
    for ex in make_examples(tokenizer, "frequent_words", 2048, 2):
        coded = _main_part(ex.context, "Find the three most frequently appeared coded words. ").split(" ")
        counts = Counter(w for w in coded if w != "...")
        ranked = [w for w, _ in counts.most_common()]
        assert tuple(ranked[:3]) == ex.answers
        assert counts[ranked[2]] > counts[ranked[3]]           # the third is not tied with the fourth
        assert Counter(coded).most_common(1)[0][0] == "..."


def test_seed_determines_examples(tokenizer):
    for task in TASKS:
        a = make_examples(tokenizer, task, 1024, 2, seed=3)
        assert a == make_examples(tokenizer, task, 1024, 2, seed=3)
        b = make_examples(tokenizer, task, 1024, 2, seed=4)
        assert all(x.context != y.context and x.answers != y.answers for x, y in zip(a, b))
        assert a[0].context != a[1].context


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------


def test_score_string_match_all():
    answers = ("1234567", "Blue-Fox")
    assert string_match_all("they are 1234567 and blue-fox.", answers) == 1.0
    assert string_match_all("  The answer: 1234567\x00", answers) == 0.5
    assert string_match_all("BLUE-FOX", answers) == 0.5
    assert string_match_all("nothing here", answers) == 0.0
    assert string_match_part("blue-fox", answers) == 1.0 and string_match_part("none", answers) == 0.0
    assert TASKS["niah_multivalue"].score("1234567 blue-fox", answers) == 1.0


# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_encode_without_chat_template(tokenizer, task):
    ex = make_examples(tokenizer, task, 1024, 1)[0]
    context_ids, question_ids, chat = encode_example(ex, tokenizer)
    assert chat is False
    whole = tokenizer(ex.context + ex.question + ex.answer_prefix)["input_ids"]
    assert context_ids + question_ids == whole and len(whole) == ex.length
    assert context_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(context_ids[1:]) == ex.context
    assert tokenizer.decode(question_ids) == ex.question + ex.answer_prefix


@pytest.mark.parametrize("task", list(TASKS))
def test_encode_with_chat_template(tokenizer, chat_tokenizer, task):
    ex = make_examples(tokenizer, task, 1024, 1)[0]
    context_ids, question_ids, chat = encode_example(ex, chat_tokenizer)
    assert chat is True
    rendered = chat_tokenizer.apply_chat_template([{"role": "user", "content": ex.context + ex.question}],
                                                  add_generation_prompt=True, tokenize=False) + ex.answer_prefix
    assert context_ids + question_ids == chat_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(context_ids) == "<|im_start|>user\n" + ex.context
    assert tokenizer.decode(question_ids) == ex.question + "<|im_end|>\n<|im_start|>assistant\n" + ex.answer_prefix
    assert encode_example(ex, chat_tokenizer, chat=False)[2] is False
    assert encode_example(ex, chat_tokenizer, chat=False)[:2] == encode_example(ex, tokenizer)[:2]


def test_encode_refuses_a_token_across_the_split(tokenizer):
    ex = make_examples(tokenizer, "niah_single", 512, 1)[0]
    glued = ruler.Example(**{**ex.__dict__, "context": ex.context + "\nThe gr", "question": "ass is green." + ex.question})
    assert any(len(t) > 3 for t in tokenizer.tokenize(" grass"))          # "grass" is one BPE piece
    with pytest.raises(ValueError, match="straddles"):
        encode_example(glued, tokenizer)


def test_larger_haystack_only_adds_text():
    """The draws do not depend on the haystack size, so the needles keep their order and the
    bisection sees token counts that grow with the size."""
    import random

    small = ruler.niah_multikey(random.Random("x"), 40, "noise", 1024)
    large = ruler.niah_multikey(random.Random("x"), 400, "noise", 1024)
    assert small[1:] == large[1:]
    assert NEEDLE.findall(small[0]) == NEEDLE.findall(large[0]) and len(large[0]) > len(small[0])


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------


def test_jsonl_round_trip(tokenizer, tmp_path):
    examples = make_examples(tokenizer, "niah_multiquery", 512, 2) + make_examples(tokenizer, "common_words", 1024, 1)
    path = write_jsonl(examples, tmp_path / "ruler.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(line.startswith('{"task": ') for line in lines)
    back = read_jsonl(path)
    assert back == examples and isinstance(back[0].answers, tuple)
