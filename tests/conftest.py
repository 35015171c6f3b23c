"""Fixtures shared by the test modules."""

import pytest

from tiny_models import tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face model directory (what ``--model DIR`` loads)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    handle = tiny_model("llama")
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    return d
