"""The architecture exceptions (:data:`attngeom.model.adapter.EXCEPTIONS`, docs/design.md "Extending
attngeom"): a ``model_type`` named there is refused with its reason, in one line, by
:func:`~attngeom.model.adapter.check_supported`, before any weight of a model directory is read, by
:func:`attngeom.wrap` and by the command line (exit 2, nothing written); every other architecture
still passes. ``EXCEPTIONS`` is empty in this release, so each test adds an entry for the tiny Llama."""

import re

import pytest

from attngeom import load_model, wrap
from attngeom.cli import main
from attngeom.errors import UnsupportedArchitectureError
from attngeom.model import adapter
from attngeom.model import loading
from attngeom.model.adapter import SUPPORTED_ARCHITECTURES, check_supported
from tiny_models import ARCHS, tiny_config

REASON = "its attention output is rescaled after o_proj (a reason for this test only)"


@pytest.fixture
def llama_is_an_exception(monkeypatch):
    monkeypatch.setitem(adapter.EXCEPTIONS, "llama", REASON)


def test_an_exception_is_refused_with_its_reason_and_the_others_pass(llama_is_an_exception):
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_supported(tiny_config("llama"))
    assert str(info.value) == f"llama: {REASON}"
    for arch in ARCHS:
        if arch != "llama":
            check_supported(tiny_config(arch))


def test_without_the_entry_the_same_config_passes():
    assert "llama" not in adapter.EXCEPTIONS
    check_supported(tiny_config("llama"))


def test_no_exception_is_also_listed_as_supported():
    assert not set(adapter.EXCEPTIONS) & set(SUPPORTED_ARCHITECTURES)


def test_a_directory_of_an_exception_is_refused_before_its_weights_are_read(llama_is_an_exception, tiny_llama_dir,
                                                                             monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read although the architecture is refused")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(UnsupportedArchitectureError, match=f"^llama: {re.escape(REASON)}$"):
        load_model(str(tiny_llama_dir))


def test_wrap_refuses_an_exception(llama_is_an_exception, tiny_llama):
    with pytest.raises(UnsupportedArchitectureError, match=f"^llama: {re.escape(REASON)}$"):
        wrap(tiny_llama.model, tiny_llama.tokenizer)


def test_the_command_line_refuses_an_exception_in_one_line(llama_is_an_exception, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", "a b c d", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"attngeom analyze: error: llama: {REASON}"
    assert all(line.startswith("attngeom") for line in err)                   # no traceback
    assert not out.exists() or not any(out.iterdir())
