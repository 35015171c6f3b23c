"""The bundled SmolLM2-135M (the ``smollm2`` session fixture, marker ``slow``): a trace's size on disk,
the sink statistics against model space, one faithfulness window and a chat answer through the
model's template."""

import numpy as np
import pytest
import torch

from attngeom.faithfulness.experiment import experiment as faithfulness_experiment
from attngeom.faithfulness.experiment import window_units
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.generation.decoding import model_stop_ids
from attngeom.metrics import formulas as M
from attngeom.sinks import SinkStats
from attngeom.traces.trace import Trace, analyze
from attngeom.streaming import stream
from checks import METRICS, assert_same_trace, metric_error

pytestmark = pytest.mark.slow


def test_trace_of_ten_tokens_is_small(smollm2, tmp_path):
    """A 10-token trace holds no per-layer W_O or G unless asked (``weights=True``)."""
    tr = analyze(smollm2, list(range(100, 110)))
    small = tr.save(tmp_path / "small") / "tensors.safetensors"
    big = tr.save(tmp_path / "big", weights=True) / "tensors.safetensors"
    assert small.stat().st_size < 2.5e6 < 40e6 < big.stat().st_size
    assert_same_trace(tr, Trace.load(small.parent))


def test_cos_v0_m_in_model_space(smollm2):
    text = "The history of the city goes back to a small fishing village on the river."
    layers = [0, 15, 29]
    stats = SinkStats()
    stream(smollm2, [text], [stats], layers=layers, progress=False)
    heads = stats.result()["heads"]
    tr = analyze(smollm2, text, layers=layers)
    for lt in tr.layers:
        A = torch.from_numpy(lt.attention).double()
        W = M.head_blocks(lt.w_o, A.shape[0]).double()
        vt = torch.einsum("htd,hdk->htk", lt.v.double(), W)
        m = A[..., 1:] @ vt[:, 1:]
        cos = torch.nn.functional.cosine_similarity(vt[:, 0:1].expand_as(m), m, dim=-1)[:, 1:]
        sub = heads[heads.layer == lt.index].sort_values("head")
        assert np.allclose(sub.cos_v0_m, cos.mean(1), atol=1e-3)
        assert np.allclose(sub.sink_rate, A[:, 1:, 0].mean(1), atol=1e-4)


def test_faithfulness_of_one_short_window(smollm2):
    units = window_units([smollm2.encode("The quick brown fox jumps over the lazy dog. " * 3)[:24]])
    settings = FaithfulnessSettings(metrics=("contribution", "random"), ratios=(0.5,), seeds=(0,))
    res = faithfulness_experiment(smollm2, None, units=units, settings=settings, progress=False)
    table, summary = res.tables["table"], res.summary
    assert summary["clean"] < 1e4 and len(table) == 4
    # masking the most important half hurts more than masking the least important half
    c = table[table.metric == "contribution"].set_index("mode")["change"]
    assert c["comprehensiveness"] > c["sufficiency"]


def test_chat_answer(smollm2):
    """SmolLM2-135M-Instruct through its chat template: the greedy answer equals model.generate's,
    it ends on the template's end of turn (the model's EOS), and the rows captured step by step
    equal one forward pass of prompt + answer."""
    trace = analyze(smollm2, "What is the capital of France?", generate=12, chat=True, layers=[0, 15, 29])
    P = trace.prompt_length
    with torch.no_grad():
        ref = smollm2.model.generate(torch.tensor([trace.ids[:P]]), max_new_tokens=12, do_sample=False)
    assert trace.ids == ref[0].tolist()
    assert trace.ids[-1] in model_stop_ids(smollm2) and len(trace.ids) < P + 12      # it stopped by itself
    full = analyze(smollm2, trace.ids, layers=[0, 15, 29])
    for a, b in zip(trace.layers, full.layers):
        for m in METRICS:
            assert metric_error(getattr(a, m)[:, P:], getattr(b, m)[:, P:], m) < 1e-4, (a.index, m)
