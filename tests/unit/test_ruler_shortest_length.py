"""A --length too short for a task names the length the task can be made at: following the message
works the first time. variable_tracking's few-shot example grows with the length asked, so its smallest
prompt at a short length (e.g. 301 SmolLM2 tokens at 64) is refused again at that length (331, then
336); the message follows the count to where the prompt fits."""

import re

import pytest

from attngeom.kvcache import ruler
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_model("llama").tokenizer


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_the_length_a_too_short_length_is_told_to_use_makes_the_task(tokenizer, task):
    with pytest.raises(ValueError, match="is too short") as e:
        ruler.make_examples(tokenizer, task, 16, 1, haystack="noise")
    need = int(re.search(r"its smallest prompt has (\d+)$", str(e.value)).group(1))
    (ex,) = ruler.make_examples(tokenizer, task, need, 1, haystack="noise")
    assert ex.length <= need
    with pytest.raises(ValueError, match=f"has {need}$"):          # one less is still refused, with the same count
        ruler.make_examples(tokenizer, task, need - 1, 1, haystack="noise")
