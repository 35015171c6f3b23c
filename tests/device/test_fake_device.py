"""attngeom's GPU path on fake CUDA devices (tests/fake_devices.py; docs/testing.md, "The GPU path
without a GPU").

A tiny random model is placed on a fake ``cuda:0`` in bf16, or split over ``cuda:0`` and ``cuda:1``
as ``device_map`` places a model, and run through the capture plug-in, the streaming reducers, the
interventions, generation and the compressed KV cache. Fake tensors carry shapes, dtypes and
devices but no data, so each path runs as far as it goes before a value must come to the host;
any operation mixing a ``cuda`` tensor with a ``cpu`` one raises ``FakeTensorDeviceMismatchError``
and fails the test, so every host copy on the way is an explicit one. What the fakes cannot
follow (a value read on the host) is listed in :data:`HOST_BOUNDARIES` and checked statically by
:func:`test_every_host_copy_of_the_gpu_path_is_a_documented_boundary`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError
from torch.utils._python_dispatch import TorchDispatchMode

import attngeom
from attngeom.capture.interventions import HeadRemoval, SourceMask
from attngeom.capture.session import attngeom_attention_implementation, Session
from attngeom.generation.decoding import Decoding, GrowingCache, GrowingNorms, generate
from attngeom.kvcache.cache import CompressedCache, cached_forward, compressing
from attngeom.metrics import registry
from attngeom.heads.taxonomy import TaxonomyStats
from attngeom.model.adapter import adapter_for
from attngeom.selection import reducer as selection_reducer
from attngeom.selection.reducer import COLUMNS, QueryResult, SelectionStats
from attngeom.sinks.reducer import SinkStats
from attngeom.sinks.removal import SourceRemoval
from attngeom.streaming.reducers import FullCapture, HeadStats, InputBatch, TokenStats
from fake_devices import CUDA0, CUDA1, fake_cuda, to_fake
from tiny_models import tiny_model

# the output projection's cache key reads parameters' data pointers, which fake tensors warn about
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")

ROOT = Path(__file__).resolve().parents[2]
T = 7          # inside the tiny models' sliding window of 8: no mask, the plug-in's causal path (a mask is a boundary)


def _forward(handle, session: Session, ids: torch.Tensor) -> torch.Tensor:
    """One text, no padding: the model's forward without an attention mask (as generation's prompt
    call runs; a padding or sliding-window mask is read on the host per block, a boundary)."""
    device = handle.model.device
    with attngeom_attention_implementation(handle.model), session.active(torch.tensor([ids.shape[1]], device=device)):
        return handle.model(input_ids=ids.to(device), use_cache=True).logits.float()   # no cache: fake positions force a mask


class DeviceCheck:
    """Observer: every metric of the registry, the received sums, the factors and the per-query
    quantities of each block, with the device and dtype each lands on."""

    def __init__(self):
        self.seen: dict[int, set] = {}

    def observe(self, block) -> None:
        dev = block.a.device
        # value zeroing decides on the host where its closed form cancels (a boundary)
        # gradients and rollouts are computed before the forward (their passes are not under fake tensors)
        before = registry.prepared_names(registry.names())
        out = [block.metric(m) for m in registry.per_head_names() if m != "value_zeroing" and m not in before]
        out += [block.token_score(m) for m in registry.rivals() if m != "value_zeroing" and m not in before]
        out += list(block.received(block.query_valid.float()).values())
        out += list(block.factors().values())
        out += [block.entropy, block.head_output_norm, block.output_norm, block.head_share, block.layer_output]
        for x in out:
            assert x.device == dev and x.dtype == torch.float32, (x.device, x.dtype)
        self.seen.setdefault(block.layer, set()).add(str(dev))


def _fake_model(arch: str, device_map=None):
    handle = tiny_model(arch)
    adapter_for(handle.model)             # discovery compares values: it runs on the real model first
    mode_cm = fake_cuda()
    mode = mode_cm.__enter__()
    to_fake(mode, handle.model, device_map=device_map)
    return handle, mode_cm


@pytest.fixture
def fake(request):
    """``(handle, layer devices)``: the tiny model of ``request.param`` (arch, split) on fake devices."""
    arch, split = request.param
    layers = tiny_model(arch).num_layers
    device_map = None
    if split:
        device_map = {"model.embed_tokens": CUDA0, "model.rotary_emb": CUDA0, "model.norm": CUDA1, "lm_head": CUDA1,
                      **{f"model.layers.{i}": (CUDA0 if i < layers // 2 else CUDA1) for i in range(layers)}}
    handle, cm = _fake_model(arch, device_map)
    want = {i: str(device_map[f"model.layers.{i}"]) if split else str(CUDA0) for i in range(layers)}
    try:
        yield handle, want
    finally:
        cm.__exit__(None, None, None)


def test_fake_devices_catch_an_implicit_host_mix():
    with fake_cuda():
        x = torch.ones(3, 4, device=CUDA0)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(3, 4)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x.to(CUDA1) @ x.T
        assert (x.cpu() + torch.ones(3, 4)).device.type == "cpu"      # an explicit copy is fine
        assert x[:, 1:3][..., None].shape == (3, 2, 1) and x[torch.tensor([0, 2], device=CUDA0)].shape == (2, 4)
        with pytest.raises(DataDependentOutputException):
            x.sum().item()


CASES = [("llama", False), ("gemma2", False), ("qwen3", False), ("llama", True)]
IDS = ["llama", "gemma2-softcap", "qwen3-qk-norm", "llama-split-2-devices"]


@pytest.mark.parametrize("fake", CASES, ids=IDS, indirect=True)
def test_capture_and_reducers_stay_on_the_device(fake):
    handle, want = fake
    ids = torch.randint(3, 100, (1, T))
    batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
    check, heads, tokens, full = DeviceCheck(), HeadStats(), TokenStats(), FullCapture()
    for r in (heads, tokens, full):
        r.begin(batch)
    logits = _forward(handle, Session(observers=[check, heads, tokens, full], block_elements=40), ids)
    assert {l: s for l, s in check.seen.items()} == {l: {d} for l, d in want.items()}
    assert logits.shape == (1, T, handle.model.config.vocab_size) and logits.dtype == torch.float32
    for layer, device in want.items():                   # the sums stay on each layer's device until end / result
        assert str(heads.sums[layer]["sink_rate"].device) == device and str(heads.counts[layer].device) == device
        assert str(tokens._acc[layer]["_source"].device) == device
        assert str(tokens._acc[layer]["value_norm"].device) == device
        # a trace's full maps are its host state, reached by explicit copies
        assert full.layers[layer]["a"].device.type == "cpu" and full.layers[layer]["v"].device.type == "cpu"


class HostCopies(TorchDispatchMode):
    """Counts the copies from an accelerator to the host (``_to_copy`` or ``copy_`` into a ``cpu``
    tensor from a ``cuda`` one) while it is active, inside the fake mode."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        src = args[1] if name == "copy_" else args[0]
        dst = args[0] if name == "copy_" else out
        if (name in ("_to_copy", "copy_") and isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type == "cuda" and dst.device.type == "cpu"):
            self.copies += 1
        return out


@pytest.mark.parametrize("fake", CASES, ids=IDS, indirect=True)
def test_the_summaries_copy_nothing_to_the_host_per_block(fake):
    """``HeadStats`` and ``TokenStats`` (what ``attngeom analyze`` streams) add each block into sums
    on the layer's device: the forward makes no copy to the host (on a GPU each would wait for the
    device); the copies come at ``end`` (once per layer), ``result`` and ``state``, whose numpy
    tables fake tensors cannot make (a host boundary). The block path (``route="block"``; the fused
    route, which ``auto`` takes on CUDA: tests/device/test_fused_route.py)."""
    handle, want = fake
    ids = torch.randint(3, 100, (1, T))
    batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
    heads, tokens = HeadStats(), TokenStats()
    for r in (heads, tokens):
        r.begin(batch)
    with HostCopies() as counter:
        _forward(handle, Session(observers=[heads, tokens], block_elements=40, route="block"), ids)
        assert counter.copies == 0
        torch.ones(1, device=CUDA0).cpu()                    # the counter sees a copy when there is one
    assert counter.copies == 1
    assert len(heads.sums) == len(tokens._acc) == len(want)


@pytest.mark.parametrize("fake", CASES, ids=IDS, indirect=True)
def test_the_sink_and_head_statistics_copy_nothing_to_the_host_per_block(fake):
    """``SinkStats`` (``attngeom sinks``: values, queries, drift, decomposition, with their
    histograms and bins), the sink removal ``SourceRemoval`` (an intervention that records the
    outputs it leaves) and ``TaxonomyStats`` (``attngeom heads``) add each block into sums on the
    layer's device: no copy to the host during the forward; the copies come at ``result`` / ``state``
    (host boundaries). Blocks of one query each: the first (no query after the sink) is skipped
    from its position alone."""
    handle, want = fake
    ids = torch.randint(3, 100, (1, T))
    batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
    stats, taxonomy, removal = SinkStats(), TaxonomyStats(), SourceRemoval("sink")
    for r in (stats, taxonomy, removal):
        r.begin(batch)
    with HostCopies() as counter:
        logits = _forward(handle, Session(observers=[stats, taxonomy], intervention=removal, block_elements=40), ids)
    assert counter.copies == 0 and logits.shape[:2] == (1, T)
    for layer, device in want.items():
        for part in stats.parts:
            assert {str(x.device) for x in part.acc[layer].values()} == {device}, type(part).__name__
        assert {str(x.device) for x in removal.acc[layer].values()} == {device}
        assert str(taxonomy.sums[layer]["align_sink"].device) == device


@pytest.mark.parametrize("fake", CASES, ids=IDS, indirect=True)
def test_the_selection_geometry_runs_on_the_device_up_to_one_host_copy_per_query(fake, monkeypatch):
    """``SelectionStats`` (``attngeom selection``) at every query: the candidates of a causal query
    are known from its position, the random orders are drawn on the host (the same on every device)
    and moved to the device, and the geometry, the bounds, the regime, the prediction and the best
    sizes are computed there (``query_geometry``); ``on_host`` (a boundary) copies them once."""
    handle, want = fake
    seen = []

    def on_host(g):
        seen.append(g)
        empty = {k: np.array([]) for k in ("kind", "distance", "head", "N", *COLUMNS)}
        return QueryResult(rows=empty, regime={"head": np.arange(g.heads)}, violations=0, selections=0)

    monkeypatch.setattr(selection_reducer, "on_host", on_host)
    ids = torch.randint(3, 100, (1, T))
    sel = SelectionStats(repeats=2, queries="all", ns=[1, 2, 4])
    sel.begin(InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0]))
    with HostCopies() as counter:
        _forward(handle, Session(observers=[sel], block_elements=40), ids)
    assert counter.copies == 0
    assert len(seen) == len(want) * (T - 1)                  # every layer, queries 1 .. T-1
    for g in seen:
        tensors = [g.violations, *g.regime.values(), *g.best_n.values(),
                   *(x for *_, cols in g.groups for x in cols.values())]
        assert len({str(x.device) for x in tensors}) == 1
    assert {str(g.violations.device) for g in seen} == set(want.values())
    assert {kind for g in seen for kind, *_ in g.groups} == {"topn", "random", "topn_nosink", "random_nosink"}
    assert any("best_n_pred_euclidean" in g.best_n for g in seen)


@pytest.mark.parametrize("has_sink", [True, False], ids=["sink", "no-sink"])
def test_one_querys_selection_geometry_stays_on_its_device(has_sink):
    """``query_geometry`` with and without the sink among the candidates (a sliding window hides
    it), in bf16 on ``cuda:1``: before, the random orders, the regime's constants, the model's
    positions and the bound check were host tensors, and the first product mixing them failed."""
    with fake_cuda():
        a, v = torch.rand(3, 40, device=CUDA1, dtype=torch.bfloat16), torch.rand(3, 40, 8, device=CUDA1, dtype=torch.bfloat16)
        g = selection_reducer.query_geometry(a, v, has_sink, ns=[1, 2, 4, 16], repeats=3, dtype=torch.float32)
        tensors = [g.violations, *g.regime.values(), *g.best_n.values(), *(x for *_, cols in g.groups for x in cols.values())]
        assert {x.device for x in tensors} == {CUDA1}
        kinds = ("topn", "random", "topn_nosink") + (("random_nosink",) if has_sink else ())
        assert {(kind, dist) for kind, dist, *_ in g.groups} == {(k, d) for k in kinds for d in ("euclidean", "cosine")}
        assert g.groups[0][3]["F"].shape == (3, 4) and g.regime["lam"].shape == (3,)


@pytest.mark.parametrize("fake", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:], indirect=True)
def test_a_session_without_a_budget_takes_each_layers_device_budget(fake, monkeypatch):
    """The default block budget follows the device of each layer's call: the accelerator's on fake
    ``cuda`` devices (both halves of a split model), the CPU's for the same model on the host."""
    from attngeom.capture import kernel

    handle, want = fake
    seen = []
    real = kernel.query_blocks

    def spy(B, H, Tq, S, budget, min_queries=1):
        seen.append((budget, min_queries))
        return real(B, H, Tq, S, budget, min_queries)

    monkeypatch.setattr(kernel, "query_blocks", spy)
    _forward(handle, Session(), torch.randint(3, 100, (1, T)))
    assert seen == [(kernel.ACCELERATOR_BLOCK_ELEMENTS, kernel.MIN_BLOCK_QUERIES)] * len(want)
    seen.clear()
    _forward(handle, Session(block_elements=40), torch.randint(3, 100, (1, T)))
    assert seen == [(40, 1)] * len(want)                  # an explicit budget is used as given


def test_the_default_budgets_give_the_measured_block_counts():
    """Hand-computed: SmolLM2-135M's 9 heads at T = 8192 make 128 blocks of 64 queries per layer with
    the CPU's 2^21 elements (the element budget alone would give 28 queries: the floor of 64 holds),
    and 10 with the accelerator's 2^26 (2^26 // (9 * 8192) = 910 queries: nine blocks and the last 2)."""
    from attngeom.capture import kernel

    assert Session().budget("cpu") == kernel.DEFAULT_BLOCK_ELEMENTS == 1 << 21
    assert Session().budget("cuda:1") == Session().budget(torch.device("cuda")) == kernel.ACCELERATOR_BLOCK_ELEMENTS
    assert Session(block_elements=500).budget("cuda") == 500
    cpu = kernel.query_blocks(1, 9, 8192, 8192, Session().budget("cpu"), kernel.MIN_BLOCK_QUERIES)
    gpu = kernel.query_blocks(1, 9, 8192, 8192, Session().budget("cuda"), kernel.MIN_BLOCK_QUERIES)
    assert len(cpu) == 128 and cpu[0] == (0, 64)
    assert len(gpu) == 10 and gpu[0] == (0, 910) and gpu[-1] == (8190, 8192)


@pytest.mark.parametrize("memory, budget", [
    (150_109_880_320, 1 << 26),      # H200 (139.8 GiB, as torch reports it): the largest default
    (85_899_345_920, 1 << 26),       # 80 GiB
    (42_949_672_960, 1 << 25),       # 40 GiB
    (25_393_692_672, 1 << 24),       # 24 GiB card
    (15_843_721_216, 1 << 23),       # T4
    (1 << 30, 1 << 21),              # 1 GiB: never below the CPU's budget
    (None, 1 << 26),                 # torch cannot say: the accelerator default
])
def test_the_accelerator_budget_fits_the_devices_memory(monkeypatch, memory, budget):
    """Hand-computed: the largest power of two at most ``memory / 1024`` elements, between the CPU's
    2^21 and 2^26 (a float32 map at most 1/256 of the device)."""
    from attngeom.capture import kernel

    monkeypatch.setattr(kernel, "device_memory", lambda device: memory)
    assert kernel.default_block_elements("cuda:0") == Session().budget("cuda") == budget
    assert kernel.default_block_elements("cpu") == 1 << 21         # the CPU's is never the device's


@pytest.mark.parametrize("fake", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:], indirect=True)
def test_interventions_stay_on_the_device(fake):
    handle, want = fake
    ids = torch.randint(3, 100, (1, T))
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[5:, 0] = True
    for intervention in (HeadRemoval({0: [1], 1: [0, 2]}), SourceMask(mask)):
        check = DeviceCheck()
        out = _forward(handle, Session(observers=[check], intervention=intervention), ids)
        assert out.shape[:2] == (1, T) and check.seen == {l: {d} for l, d in want.items()}


@pytest.mark.parametrize("fake", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:], indirect=True)
def test_generation_steps_stay_on_the_device(fake, monkeypatch):
    """The prompt and 5 decoding steps in the growing KV cache, every call observed. The token
    choice reads the logits on the host (a boundary): here it returns a fixed token."""
    handle, want = fake
    monkeypatch.setattr(Decoding, "choose", lambda self, logits, gen: 7)
    check, heads, norms = DeviceCheck(), HeadStats(), GrowingNorms(T + 5)
    cache = GrowingCache(T + 5)
    answer = generate(handle, list(range(3, 3 + T)), Decoding(5, stop=()), Session(observers=[norms, check, heads]),
                      cache=cache)
    assert answer == [7] * 5 and cache.get_seq_length() == T + 5
    assert check.seen == {l: {d} for l, d in want.items()}
    for layer, d in want.items():
        assert str(cache.layers[layer].keys.device) == d and norms.norms[layer][0].tensor.shape[-1] == T + 5
        assert str(norms.norms[layer][0].tensor.device) == d


def test_the_answer_tables_join_their_rows_on_each_rows_device():
    """AnswerSources copies a step's rows to the host once per device: under device_map the layers'
    rows live on several devices, and no product or join mixes them."""
    from attngeom.generation.answers import rows_by_device

    with fake_cuda():
        rows = [torch.ones(2, 5, device=CUDA0), torch.ones(2, 5, device=CUDA1), torch.ones(2, 3, device=CUDA0)]
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.cat(rows, dim=1)                       # what one join of every row would do
        joined = rows_by_device(rows)
        assert [(idx, j.device, tuple(j.shape)) for idx, j in joined] == [([0, 2], CUDA0, (2, 8)), ([1], CUDA1, (2, 5))]


@pytest.mark.parametrize("fake", CASES[:1], ids=IDS[:1], indirect=True)
def test_compressed_cache_scores_stay_on_the_device(fake):
    """A prompt read into a compressed cache whose policy records scores from the capture
    (CacheScorer). Eviction itself decides on the host (a boundary)."""
    handle, want = fake
    cache = CompressedCache(handle.model.config, "h2o", budget=64)
    with compressing(handle.model, cache):
        logits = cached_forward(handle, cache, torch.randint(3, 100, (1, T)))
    assert logits.shape[:2] == (1, T)
    for layer in want:
        assert cache.layers[layer].step.device == CUDA0 and cache.layers[layer].keys.device == CUDA0


# --------------------------------------------------------------------------------------------
# What fake tensors cannot follow: every host read of the GPU path, documented
# --------------------------------------------------------------------------------------------

GPU_PATH = ("capture/blocks.py", "capture/kernel.py", "capture/session.py", "capture/interventions.py",
            "capture/routes.py",
            "streaming/reducers.py", "generation/decoding.py", "generation/answers.py",
            "kvcache/cache.py", "kvcache/evaluation.py", "kvcache/policies/base.py", "kvcache/policies/budgets.py",
            "kvcache/policies/kvzip.py", "kvcache/prefill.py", "kvcache/tasks.py",
            "metrics/formulas.py", "metrics/registry.py", "metrics/leave_one_out.py", "metrics/value_zeroing.py",
            "metrics/alti.py", "sinks/reducer.py", "sinks/removal.py", "sinks/geometry.py", "selection/reducer.py",
            "selection/separation.py", "selection/prediction.py", "heads/taxonomy.py")
HOST_METHODS = ("cpu", "numpy", "item", "tolist", "nonzero", "equal")
"""Calls that bring a tensor's values to the host (``torch.equal`` and ``nonzero`` decide on them)."""
HOST_BUILTINS = ("int", "float", "bool")
"""Python conversions of a computed value (a call or a subscript: ``int(x.max())``, ``bool(m.all())``)."""


def _is_host_read(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute):
        return node.func.attr in HOST_METHODS
    return (isinstance(node.func, ast.Name) and node.func.id in HOST_BUILTINS and len(node.args) == 1
            and isinstance(node.args[0], (ast.Call, ast.Subscript)))


def _host_calls() -> dict[tuple[str, str], int]:
    """``{(module, function): count}`` of the host reads in the GPU path's modules; functions are
    named as ``Class.method`` or ``function`` (the innermost enclosing definition)."""
    pkg = Path(attngeom.__file__).parent
    out: dict[tuple[str, str], int] = {}
    for rel in GPU_PATH:
        tree = ast.parse((pkg / rel).read_text(encoding="utf-8"))
        owner: dict[int, str] = {}

        def visit(node, name):
            for child in ast.iter_child_nodes(node):
                inner = name
                if isinstance(child, ast.ClassDef):
                    inner = child.name
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = f"{name}.{child.name}" if name and name[0].isupper() and "." not in name else child.name
                owner[id(child)] = inner
                visit(child, inner)

        visit(tree, "")
        for node in ast.walk(tree):
            if _is_host_read(node):
                key = (rel, owner.get(id(node)) or "<module>")
                out[key] = out.get(key, 0) + 1
    return out


def _documented() -> set[tuple[str, str]]:
    """The ``(module, function)`` rows of docs/testing.md's table of host boundaries."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    section = text.split("### Host boundaries", 1)[1].split("\n#", 1)[0]
    return {(m, f) for m, f in re.findall(r"^\| `([\w/]+\.py)` \| `([\w.]+|<module>)` \|", section, re.M)}


def test_every_host_copy_of_the_gpu_path_is_a_documented_boundary():
    found, documented = set(_host_calls()), _documented()
    assert found - documented == set(), f"host copies not documented in docs/testing.md: {sorted(found - documented)}"
    assert documented - found == set(), f"documented host boundaries that no longer exist: {sorted(documented - found)}"
