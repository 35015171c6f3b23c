"""attngeom.experiment: the one perplexity rule, and the one result shape of every experiment."""

import math

import numpy as np
import pytest

from attngeom import bootstrap as bs
from attngeom.experiment import ExperimentResult, ModelHandleLike, RunLike, perplexity
from attngeom.runner import Memory


def test_perplexity_scalar_array_and_zero_tokens():
    assert perplexity(6.0, 3) == math.exp(2.0)
    assert isinstance(perplexity(np.float64(6.0), np.int64(3)), float)
    assert math.isnan(perplexity(0.0, 0)) and math.isnan(perplexity(5.0, 0))
    got = perplexity(np.array([[6.0, 1.0], [0.0, 2.0]]), np.array([[3.0, 1.0], [0.0, 4.0]]))
    assert got[0, 0] == pytest.approx(math.exp(2.0), rel=1e-15) and got[0, 1] == pytest.approx(math.e, rel=1e-15)
    assert np.isnan(got[1, 0]) and got[1, 1] == pytest.approx(math.exp(0.5), rel=1e-15)


def test_resampled_perplexity_follows_the_same_rule():
    nll = np.array([[4.0], [9.0]])
    tok = np.array([0.0, 3.0])
    counts = np.array([[2, 0], [1, 1]])
    got = bs.perplexity(counts, nll, tok)
    assert np.isnan(got[0, 0])                                   # the resample holds no token
    assert got[1, 0] == pytest.approx(math.exp(13.0 / 3.0), rel=1e-15)


def test_memory_run_and_a_handle_satisfy_the_protocols():
    from tiny_models import tiny_model

    assert isinstance(Memory(), RunLike)
    assert isinstance(tiny_model("llama"), ModelHandleLike)
    r = ExperimentResult("x")
    assert r.tables == {} and r.summary == {} and r.per_window == {}
