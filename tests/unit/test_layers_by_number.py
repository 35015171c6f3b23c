"""``trace.layers`` is keyed by layer number (issue 51), and the model handle prints one line."""

from __future__ import annotations

import numpy as np
import pytest

from attngeom.errors import InputError
from attngeom.traces.trace import analyze
from tiny_models import tiny_model


def test_layers_are_keyed_by_number_after_a_subset(tiny_llama):
    whole = analyze(tiny_llama, "The cat sat.")
    part = analyze(tiny_llama, "The cat sat.", layers=[0, 2])
    assert part.layers.numbers == [0, 2] and len(part.layers) == 2 and 2 in part.layers and 1 not in part.layers
    assert part.layers[2].index == 2                               # not the second analysed layer by position
    assert np.allclose(part.layers[2].contribution, whole.layers[2].contribution, atol=1e-5)
    assert [lt.index for lt in part.layers] == [0, 2]              # iteration: the layers, in order
    assert [n for n, _ in part.layers.items()] == [0, 2]
    for bad, match in ((1, r"layer 1 is not in the trace; it holds layers \[0, 2\]"), (-1, "layer -1"),
                       (slice(0, 1), "takes a layer number"), ("2", "takes a layer number")):
        with pytest.raises(InputError, match=match) as e:
            part.layers[bad]
        assert "\n" not in str(e.value)
    lt = part.layers.pop(0)
    assert lt.index == 0 and part.layers.numbers == [2]


def test_model_handle_repr_is_one_short_line():
    h = tiny_model("llama")
    r = repr(h)
    assert r == "ModelHandle(tiny-llama: llama, 3 layers, 4 heads (2 kv), float32 on cpu)"
    assert "\n" not in r and len(r) < 120
