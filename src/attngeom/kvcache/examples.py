"""The one check of long-context task examples (:class:`~attngeom.kvcache.ruler.Example`), before any compute.

Two steps, each refusing bad input in one :class:`~attngeom.errors.InputError` that names the example:

- :func:`check_examples` (no model; called by :func:`attngeom.kvcache.ruler.read_jsonl` for every
  line it reads, and by :func:`attngeom.kvcache.tasks.experiment` for examples made in code): the
  fields' ranges (``index >= 0``, ``length >= 1``, ``max_new_tokens >= 1``), a task name other than
  :data:`~attngeom.kvcache.tasks.ALL_TASKS` (the summary's row over every task), a context and a
  question that say something, a question that begins with ``"\\n"`` (where RULER's template splits
  it from the context), at least one reference answer and no empty one (an empty string is found in
  every answer), and each (task, index) once.
- :func:`attngeom.kvcache.tasks.encode_examples` (the model's tokenizer and positions): every
  example's tokens, split where its question begins, and ``context + question + max_new_tokens``
  within the model's positions (:func:`attngeom.model.arguments.check_positions`), before the first
  prefill; and :func:`attngeom.kvcache.tasks.check_length`, a ``--length`` to make examples of,
  before they are made (a length of 10^9 is refused, not built).

What belongs here: the checks that need no model (this module imports nothing of the kvcache
package, so that the task generator's :func:`~attngeom.kvcache.ruler.read_jsonl` can call them).
Not here: the task generator (:mod:`attngeom.kvcache.ruler`), the checks against a model and the
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


def example_name(ex) -> str:
    """How a message names an example: ``example TASK/INDEX``."""
    return f"example {ex.task}/{ex.index}"


def check_example(ex, where: str | None = None) -> None:
    """One example's fields (module docstring); ``where`` names it in the message (default
    ``example TASK/INDEX``)."""
    where = where or example_name(ex)
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
        where = wheres[k] if wheres is not None else example_name(ex)
        check_example(ex, where)
        first = seen.setdefault((ex.task, ex.index), k)
        if first != k:
            said = f"line {wheres[first].rsplit(':', 1)[-1]}" if wheres is not None else "an earlier example"
            raise InputError(f"{where}: {ex.task}/{ex.index} is given twice (also on {said}); number each "
                             "example of a task once")
