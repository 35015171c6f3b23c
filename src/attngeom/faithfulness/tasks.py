"""Multiple-choice tasks from JSONL files, scored by option log-likelihood (SPEC §3).

Supported shapes (one JSON object per line):

- ``mmlu``: ``question`` (str), ``choices`` (list of str), ``answer`` (index into ``choices``, an
  int or a digit string; a letter ``A``/``B``/... is accepted too). Context
  ``"Question: {question}\\nAnswer:"``, options ``" {choice}"``.
- ``winogrande``: ``sentence`` with one ``_``, ``option1``, ``option2``, ``answer`` (``"1"``/``"2"`` or
  1/2). Each option fills the blank; the context is the sentence up to the blank with the option,
  and the scored continuation is the rest of the sentence (the usual partial scoring: the options
  are compared on the same tokens).
- ``boolq``: ``passage``, ``question``, ``answer`` (bool, or ``"true"``/``"false"``). Context
  ``"{passage}\\nQuestion: {question}?\\nAnswer:"``, options ``" no"``/``" yes"``.

An example's prediction is the option whose continuation has the highest summed log-likelihood
given its context (ties to the first option); accuracy is the share of correct predictions.
Under an intervention the masking applies to the whole input (context and continuation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from attngeom.model.arguments import takes_handle
from attngeom.errors import InputError
from attngeom.runs.contract import ModelHandleLike

TASKS = ("mmlu", "winogrande", "boolq")


@dataclass(frozen=True)
class MultipleChoice:
    """One question: ``options[k] = (context, continuation)``; ``answer`` the correct index."""

    options: tuple[tuple[str, str], ...]
    answer: int


def _int_answer(value, n: int, where: str) -> int:
    if isinstance(value, bool):
        raise InputError(f"{where}: answer must be an index, got {value!r}")
    if isinstance(value, str):
        s = value.strip()
        if len(s) == 1 and s.isalpha():
            idx = ord(s.upper()) - ord("A")
        else:
            try:
                idx = int(s)
            except ValueError:
                raise InputError(f"{where}: answer {value!r} is not an index") from None
    elif isinstance(value, int):
        idx = value
    elif isinstance(value, float) and value.is_integer():
        idx = int(value)
    else:
        raise InputError(f"{where}: answer {value!r} is not an index")
    if not 0 <= idx < n:
        raise InputError(f"{where}: answer {value!r} is out of range (there are {n} choices)")
    return idx


def _need(obj: dict, keys: Sequence[str], where: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise InputError(f"{where}: field {missing[0]!r} is missing (fields present: {', '.join(obj) or 'none'})")


def _mmlu(obj: dict, where: str) -> MultipleChoice:
    _need(obj, ("question", "choices", "answer"), where)
    choices = obj["choices"]
    if not isinstance(choices, list) or len(choices) < 2:
        raise InputError(f"{where}: 'choices' must be a list of at least 2 options")
    ans = _int_answer(obj["answer"], len(choices), where)
    ctx = f"Question: {str(obj['question']).strip()}\nAnswer:"
    return MultipleChoice(tuple((ctx, " " + str(c).strip()) for c in choices), ans)


def _winogrande(obj: dict, where: str) -> MultipleChoice:
    _need(obj, ("sentence", "option1", "option2", "answer"), where)
    sent = str(obj["sentence"])
    if sent.count("_") != 1:
        raise InputError(f"{where}: 'sentence' must contain exactly one '_' blank")
    a = obj["answer"]
    try:
        ans = int(a) - 1 if not isinstance(a, bool) else -1
    except (TypeError, ValueError):
        raise InputError(f"{where}: answer {a!r} must be 1 or 2") from None
    if ans not in (0, 1):
        raise InputError(f"{where}: answer {a!r} is out of range (must be 1 or 2)")
    pre, post = sent.split("_")
    post = post.rstrip()
    if not post.strip():
        raise InputError(f"{where}: nothing follows the blank to score")
    opts = tuple((pre + str(obj[k]), post) for k in ("option1", "option2"))
    return MultipleChoice(opts, ans)


def _boolq(obj: dict, where: str) -> MultipleChoice:
    _need(obj, ("passage", "question", "answer"), where)
    a = obj["answer"]
    if isinstance(a, str) and a.strip().lower() in ("true", "false"):
        a = a.strip().lower() == "true"
    if not isinstance(a, bool):
        raise InputError(f"{where}: answer {a!r} must be true or false")
    q = str(obj["question"]).strip().rstrip("?")
    ctx = f"{str(obj['passage']).strip()}\nQuestion: {q}?\nAnswer:"
    return MultipleChoice(((ctx, " no"), (ctx, " yes")), int(a))


_PARSERS = {"mmlu": _mmlu, "winogrande": _winogrande, "boolq": _boolq}


def load_task(path: str | Path, task: str, limit: int | None = None) -> list[MultipleChoice]:
    """Read a task file; every line is validated (missing fields, answers out of range) before use."""
    if task not in _PARSERS:
        raise InputError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    from attngeom.data.corpora import input_path, json_object

    p = input_path(path, "task file")
    if p.is_dir():
        raise InputError(f"{p} is a directory; give a .jsonl task file")
    out = []

    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        n = p.read_bytes()[:e.start].count(b"\n") + 1
        raise InputError(f"{p}:{n}: not UTF-8 text") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            where = f"{p}:{n}"
            out.append(_PARSERS[task](json_object(line, where), where))
    if not out:
        raise InputError(f"{p} holds no examples")
    return out[:limit] if limit else out


@dataclass(frozen=True)
class OptionSequence:
    """One (example, option) to score: ``ids`` (BOS + context + continuation), and the number of
    continuation tokens at the end."""

    example: int
    option: int
    ids: tuple[int, ...]
    n_cont: int


@takes_handle
def encode_options(handle: ModelHandleLike, examples: Sequence[MultipleChoice]) -> list[OptionSequence]:
    """Token ids of every (example, option): context encoded with BOS, continuation without special
    tokens, concatenated. Raises if a sequence is longer than the model's context."""
    tok = handle.tokenizer
    limit = getattr(handle, "max_positions", None)
    out = []
    for e, ex in enumerate(examples):
        for k, (ctx, cont) in enumerate(ex.options):
            c = list(handle.encode(ctx))
            t = tok(cont, add_special_tokens=False)["input_ids"]
            if not t:
                raise InputError(f"example {e}, option {k}: the option {cont!r} has no tokens")
            ids = c + list(t)
            if limit and len(ids) > limit:
                raise InputError(f"example {e}, option {k} has {len(ids)} tokens but the model handles at most {limit}")
            out.append(OptionSequence(e, k, tuple(ids), len(t)))
    return out


def accuracy(scores: dict[tuple[int, int], float], examples: Sequence[MultipleChoice]) -> float:
    """Share of examples whose best-scoring option (ties to the first) is the answer."""
    right = 0
    for e, ex in enumerate(examples):
        s = [scores[(e, k)] for k in range(len(ex.options))]
        right += int(max(range(len(s)), key=lambda k: (s[k], -k)) == ex.answer)
    return right / len(examples)
