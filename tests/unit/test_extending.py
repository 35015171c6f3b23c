"""docs/design.md's "Extending attngeom" runs as written: its ``my_metrics.py``, ``my_policies.py`` and
``my_reducers.py`` are copied into a folder outside the package (``tmp_path``), imported from there,
and what each adds is checked against an independent computation on the tiny Llama: the metric in a
trace, a ranking and a reducer's sums; the policy's selection by hand from eager attentions and a
compressed generation; the reducer against the trace's attention. Nothing of attngeom is edited."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attngeom.capture.interventions import RANK_METRICS, RankIntervention, Variant
from attngeom.metrics import registry
from attngeom.streaming import TokenStats, stream
from attngeom.traces import analyze
from tiny_models import eager_attentions, tiny_model

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
TEXT = "the cat sat on the mat while the dog slept by the door"


def examples() -> dict[str, str]:
    """The ``# my_*.py`` code blocks of the section "Extending attngeom": file name -> source."""
    page = DESIGN.read_text(encoding="utf-8")
    section = page.split("## Extending attngeom", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(# (my_\w+\.py)\n.*?)```", section, flags=re.S)
    return {name: code for code, name in blocks}


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """Imports a module of the section from ``tmp_path``; forgets the modules and the metric afterwards."""
    code = examples()
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = []

    def load(name: str):
        (tmp_path / name).write_text(code[name], encoding="utf-8")
        module = importlib.import_module(name[:-3])
        imported.append(module.__name__)
        assert Path(module.__file__).parent == tmp_path          # from outside the package
        return module

    yield load
    for name in imported:
        sys.modules.pop(name, None)
    registry.unregister("squared_attention")
    from attngeom.kvcache.policies import POLICIES

    POLICIES.pop("last16", None)


def test_the_section_has_the_three_examples():
    assert set(examples()) == {"my_metrics.py", "my_policies.py", "my_reducers.py"}


def test_a_metric_from_outside_is_everywhere_the_table_is_read(outside, tiny_llama):
    assert "squared_attention" not in registry.names()
    outside("my_metrics.py")
    trace = analyze(tiny_llama, TEXT)
    for lt in trace.layers:
        a = lt.a.numpy().astype(np.float64)
        assert np.allclose(lt.squared_attention, a ** 2, atol=1e-7)              # [H, T, T]
        assert np.allclose(lt.token_score("squared_attention"), (a ** 2).sum(0), atol=1e-6)
    assert registry.label("squared_attention") == "squared attention"
    # a ranking of the interventions: the top half of each row by the token-level score
    assert "squared_attention" in RANK_METRICS
    block = trace.layers[1].block
    mask = RankIntervention(Variant("squared_attention", "comprehensiveness", 0.5)).mask(block)
    score = torch.from_numpy((trace.layers[1].a.numpy().astype(np.float64) ** 2).sum(0))
    for i in range(1, score.shape[0]):
        k = (i + 1) // 2
        top = set(torch.topk(score[i, :i + 1], k).indices.tolist())
        assert set(torch.nonzero(mask[0, 0, i]).flatten().tolist()) == top, i
    # what each token receives (the generic received path): summed over heads, mean over the queries that see it
    tokens = TokenStats(metrics=("squared_attention",), columns=())
    stream(tiny_llama, [TEXT], [tokens], progress=False)
    got = tokens.result()
    for lt in trace.layers:
        rows = got[got["layer"] == lt.index].sort_values("position")
        T = lt.a.shape[-1]
        want = (lt.a.numpy().astype(np.float64) ** 2).sum((0, 1)) / (T - np.arange(T))
        assert np.allclose(rows["squared_attention_received"].to_numpy(), want, atol=1e-6)


def test_a_policy_from_outside_compresses_as_its_priority_says(outside):
    from attngeom.kvcache import prefill as P
    from attngeom.kvcache.policies import get_policy
    from attngeom.kvcache.generate import compressed_generate

    outside("my_policies.py")
    h = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ctx, q = torch.randint(4, 128, (40,), generator=g).tolist(), [5, 6, 7]
    policy = get_policy("my_policies:LastQueries")
    assert policy.name == "last16" and get_policy("last16") is policy
    sel = P.selection_at_ratio(P.prefill(h, ctx, [policy]), policy, 0.5, h.num_heads)
    att = eager_attentions(h, ctx)
    group = h.num_heads // h.num_kv_heads
    for layer, idx in sel.idx.items():
        score = att[layer][0, :, -16:].double().sum(1).reshape(h.num_kv_heads, group, -1).mean(1)   # [Hkv, n]
        score[:, :4] = float("inf")                                                               # the first 4
        want = score.topk(20, dim=-1).indices.sort(-1).values
        assert torch.equal(idx[0], want), layer
    out = compressed_generate(h, ctx, q, "my_policies:LastQueries", 0.5, max_new_tokens=3, do_sample=False)
    assert out[0, :len(ctx) + len(q)].tolist() == ctx + q and out.shape[1] <= len(ctx) + len(q) + 3


def test_a_reducer_from_outside_sums_what_the_trace_holds(outside, tiny_llama):
    mine = outside("my_reducers.py").FirstTokenMass()
    texts = [TEXT, "a b c d e f g h"]
    stream(tiny_llama, texts, [mine], progress=False, block_elements=64)       # several blocks per layer
    want = {}
    for text in texts:
        for lt in analyze(tiny_llama, text).layers:
            want[lt.index] = want.get(lt.index, 0.0) + float(lt.a[:, :, 0].double().sum())
    got = mine.result()
    assert set(got) == set(want)
    assert all(abs(got[k] - want[k]) < 1e-4 for k in want), (got, want)
