"""The one check of long-context task examples (:class:`~attngeom.kvcache.ruler.Example`), before any compute.

Two steps, each refusing bad input in one :class:`~attngeom.errors.InputError` that names the example:

- :func:`check_examples` (no model; called by :func:`attngeom.kvcache.ruler.read_jsonl` for every
  line it reads, and by :func:`attngeom.kvcache.tasks.experiment` for examples made in code): the
  fields' ranges (``index >= 0``, ``length >= 1``, ``max_new_tokens >= 1``), a task name other than
  :data:`~attngeom.kvcache.tasks.ALL_TASKS` (the summary's row over every task), a context and a
  question that say something, a question that begins with ``"\\n"`` (where RULER's template splits
  it from the context), at least one reference answer and no empty one (an empty string is found in
  every answer), and each (task, index) once.
- :func:`encode` (the model's tokenizer and positions): every example's tokens, split where its
  question begins, and ``context + question + max_new_tokens`` within the model's positions
  (:func:`attngeom.model.arguments.check_positions`), before the first prefill; and
  :func:`check_length`, a ``--length`` to make examples of, before they are made (a length of 10^9 is
  refused, not built).

What belongs here: these checks. Not here: the task generator (:mod:`attngeom.kvcache.ruler`), the
experiment (:mod:`attngeom.kvcache.tasks`).
"""

from __future__ import annotations

from typing import Sequence

from attngeom.errors import InputError

ALL_TASKS = "all"
"""The ``task`` of the summary rows over every task (:data:`attngeom.kvcache.tasks.ALL_TASKS`): no
example's task."""

MINIMUMS = {"index": 0, "length": 1, "max_new_tokens": 1}
"""The smallest value of each whole-number field of an example (``seed`` may be any whole number)."""

HINT = "use a shorter --length, examples with fewer tokens, or fewer tokens to generate"


def _name(ex) -> str:
    return f"example {ex.task}/{ex.index}"


def check_example(ex, where: str | None = None) -> None:
    """One example's fields (module docstring); ``where`` names it in the message (default
    ``example TASK/INDEX``)."""
    where = where or _name(ex)
    for field, low in MINIMUMS.items():
        if getattr(ex, field) < low:
            raise InputError(f"{where}: field {field!r} must be at least {low}, got {getattr(ex, field)}")
    for field in ("task", "context"):
        if not getattr(ex, field).strip():
            raise InputError(f"{where}: field {field!r} is empty")
    if ex.task == ALL_TASKS:
        raise InputError(f"{where}: task {ALL_TASKS!r} names the summary's rows over every task; give the task "
                         "another name")
    if not ex.question.startswith("\n") or not ex.question.strip():
        raise InputError(f"{where}: field 'question' must begin with a newline and ask something (the context is "
                         "split from the question there, as in RULER's templates)")
    if not ex.answers:
        raise InputError(f"{where}: field 'answers' is empty (nothing to score the answer against)")
    if any(not a.strip() for a in ex.answers):
        raise InputError(f"{where}: field 'answers' holds an empty answer (found in every answer: a score of 1 "
                         "for anything)")


def check_examples(examples: Sequence, wheres: Sequence[str] | None = None) -> None:
    """Every example (:func:`check_example`), and each (task, index) once; ``wheres`` names each
    example (a file's ``path:line``), default ``example TASK/INDEX``."""
    seen: dict[tuple[str, int], int] = {}
    for k, ex in enumerate(examples):
        where = wheres[k] if wheres is not None else _name(ex)
        check_example(ex, where)
        first = seen.setdefault((ex.task, ex.index), k)
        if first != k:
            said = f"line {wheres[first].rsplit(':', 1)[-1]}" if wheres is not None else "an earlier example"
            raise InputError(f"{where}: {ex.task}/{ex.index} is given twice (also on {said}); number each "
                             "example of a task once")


def prompt_tokens(tokenizer, ex) -> int:
    """An example's ``length`` as :mod:`~attngeom.kvcache.ruler` defines it, in ``tokenizer``'s tokens:
    the plain prompt's, special tokens (BOS) included, no chat template."""
    from attngeom.kvcache.ruler import count_tokens

    return count_tokens(tokenizer, ex.context + ex.question + ex.answer_prefix)


def encode(handle, examples: Sequence, chat: bool | None = None) -> list[tuple[list[int], list[int], bool]]:
    """:func:`attngeom.kvcache.ruler.encode_example` of every example, after :func:`check_examples`: a context
    that cannot be split from its question, an empty context, or more positions than the model
    has (``context + question + max_new_tokens``) is one :class:`InputError` naming the example."""
    from attngeom.kvcache import ruler
    from attngeom.model.arguments import check_positions

    check_examples(examples)
    out = []
    for ex in examples:
        try:
            ctx, q, applied = ruler.encode_example(ex, handle.tokenizer, chat)
        except ValueError as e:
            raise InputError(f"{_name(ex)}: {e}") from None
        if not ctx or not q:
            raise InputError(f"{_name(ex)}: its {'context' if not ctx else 'question'} has no tokens")
        check_positions(handle, len(ctx) + len(q) + ex.max_new_tokens,
                        f"{_name(ex)} ({len(ctx) + len(q)} prompt tokens, up to {ex.max_new_tokens} generated)", HINT)
        out.append((ctx, q, applied))
    return out


def check_length(handle, length: int, tasks: Sequence[str], rows: int) -> None:
    """A ``--length`` to make examples of ``tasks`` at, before any is made: its prompt and the longest
    answer of the tasks within the model's positions, and the caches of ``rows`` variants within the
    memory (:func:`attngeom.kvcache.tasks.check_memory`)."""
    from attngeom.kvcache.ruler import TASKS
    from attngeom.kvcache.tasks import check_memory
    from attngeom.model.arguments import check_positions

    new = max(TASKS[t].max_new_tokens for t in tasks)
    check_positions(handle, length + new, f"--length {length} (and up to {new} tokens generated)",
                    "use a shorter --length")
    check_memory(handle, length + new, rows)


def make_examples(tokenizer, tasks: Sequence[str], length: int, n: int, seed: int, haystack, first: int = 0) -> list:
    """:func:`attngeom.kvcache.ruler.make_examples` of every task of ``tasks``; a length a task cannot
    be made at is one :class:`InputError`."""
    from attngeom.kvcache import ruler

    try:
        return [e for t in tasks for e in ruler.make_examples(tokenizer, t, length, n, seed, haystack, first=first)]
    except (ValueError, RuntimeError) as e:
        raise InputError(f"--length {length}: {e}") from None
