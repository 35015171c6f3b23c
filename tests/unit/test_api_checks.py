"""The Python API refuses what the command line refuses, with the same error classes and messages:
layers the model does not have, and token ids it has no embedding for."""

import numpy as np
import pytest

from attngeom.errors import InputError
from tiny_models import tiny_model

TEXT = "The cat sat on the mat."
NO_LAYER = {99: "layer 99 does not exist: the model has layers 0..2", -1: "layer -1 does not exist (layers count from 0)"}
"""What the command line says (after loading the model) for --layers 99, and before it for -1."""


def _ids(handle, n=4):
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(4, handle.model.config.vocab_size, 12)] for _ in range(n)]


def _runs(handle):
    """Every entry point of the API that takes layers, as ``layers -> run it``."""
    import attngeom
    from attngeom.faithfulness import experiment as faithfulness
    from attngeom.selection import experiment as selection
    from attngeom.sinks import experiment as sinks
    from attngeom.faithfulness.settings import FaithfulnessSettings
    from attngeom.selection.settings import SelectionSettings
    from attngeom.sinks.settings import SinksSettings
    from attngeom.streaming.reducers import HeadStats

    ids = _ids(handle)
    return {
        "analyze": lambda L: attngeom.analyze(handle, TEXT, layers=L),
        "analyze_batch": lambda L: attngeom.analyze_batch(handle, [TEXT, TEXT], layers=L),
        "analyze generate": lambda L: attngeom.analyze(handle, TEXT, layers=L, generate=2),
        "stream": lambda L: attngeom.stream(handle, [TEXT], [HeadStats()], layers=L, progress=False),
        "sinks": lambda L: sinks.experiment(handle, None, ids, SinksSettings(layers=L, batch_size=1)),
        "sinks removal": lambda L: sinks.experiment(handle, None, ids, SinksSettings(removal_layers=L, batch_size=1)),
        "selection": lambda L: selection.experiment(handle, None, ids, SelectionSettings(
            ns=(2,), repeats=1, predict=False, batch_size=1, layers=L)),
        "faithfulness": lambda L: faithfulness.experiment(handle, None, faithfulness.window_units(ids), FaithfulnessSettings(
            metrics=("attention",), ratios=(0.5,), layers=L), progress=False),
    }


@pytest.mark.parametrize("layer", [99, -1])
@pytest.mark.parametrize("entry", ["analyze", "analyze_batch", "analyze generate", "stream", "sinks", "sinks removal",
                                   "selection", "faithfulness"])
def test_layers_the_model_lacks_are_refused_as_on_the_command_line(tiny_llama, entry, layer):
    with pytest.raises(InputError) as e:
        _runs(tiny_llama)[entry]((layer,))
    assert str(e.value) == NO_LAYER[layer]


def test_the_command_lines_messages_are_these(tiny_llama_dir, tmp_path, capsys):
    from attngeom.cli import main

    for layer, said in NO_LAYER.items():
        rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--layers", str(layer), "--out",
                   str(tmp_path / f"o{layer}"), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and err.strip().endswith(said), err


@pytest.mark.parametrize("layers", [("a",), (1.5,), 2, "0,1"])
def test_layers_that_are_not_layer_numbers(tiny_llama, layers):
    import attngeom

    with pytest.raises(InputError, match="layer"):
        attngeom.analyze(tiny_llama, TEXT, layers=layers)


def test_token_ids_beyond_the_embedding_are_an_input_error():
    import attngeom

    small = tiny_model("llama", vocab_size=40)         # the tokenizer knows ~100 tokens, the model 40
    with pytest.raises(InputError, match=r"token id \d+ is outside the model's vocabulary \(0\.\.39\)"):
        attngeom.analyze(small, "xyz~")                 # a text
    with pytest.raises(InputError, match=r"token id 40 is outside the model's vocabulary \(0\.\.39\)"):
        attngeom.analyze(small, [1, 5, 40])             # ids
    with pytest.raises(InputError, match=r"outside the model's vocabulary \(0\.\.39\)"):
        attngeom.analyze(small, "xyz~", generate=2)     # a prompt
    assert len(attngeom.analyze(small, [1, 5, 39])) == 3


@pytest.mark.parametrize("ids, said", [([1, True, 5], "True"), ([1, 2.7, 5], "2.7"), ([1, "5"], "'5'"),
                                       (np.array([1.0, 5.0]), r"(np\.float64\()?1\.0")])
def test_token_ids_that_are_not_whole_numbers_are_an_input_error(tiny_llama, ids, said):
    """``True``, ``2.7`` or ``"5"`` is no token id (``int()`` made them 1, 2 and 5 before): one line
    naming it, before any forward pass; numpy and torch integers are ids."""
    import torch

    import attngeom
    from attngeom.streaming.passes import check_ids, to_ids

    with pytest.raises(InputError, match=f"a token id must be a whole number, not {said}"):
        attngeom.analyze(tiny_llama, ids)
    with pytest.raises(InputError, match="a token id must be a whole number, not 2.7"):
        to_ids(tiny_llama, torch.tensor([2.7, 1.0]))
    with pytest.raises(InputError, match="a text or a sequence of token ids, not int"):
        to_ids(tiny_llama, 5)
    assert check_ids(tiny_llama, np.array([1, 5])) == [1, 5] == to_ids(tiny_llama, torch.tensor([[1, 5]]))
    assert all(type(x) is int for x in check_ids(tiny_llama, np.array([1, 5])))
