"""Adversarial inputs to the Python API's newer surfaces: ``Trace.heads_for``, ``traces.diff``,
``Trace.plot_token_map``, ``Trace.load`` and ``kvcache.compressed_generate``. Each bad input is one
:class:`~attngeom.errors.AttngeomError` of one line (never a raw AttributeError, IndexError, ValueError
or MemoryError), raised before any compute, and leaves no file behind. The tests named
``test_defect_<n>_...`` reproduce issue 52's defect ``n`` (each failed before its fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attngeom.errors import AttngeomError, InputError, OutputError, TraceFormatError
from tiny_models import tiny_model

TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def handle():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def trace(handle):
    from attngeom import analyze

    return analyze(handle, TEXT)


def refused(call, kind=InputError, match=None) -> str:
    """``call()`` raises ``kind`` (an AttngeomError) with a one-line message (matching ``match``)."""
    with pytest.raises(kind, match=match) as e:
        call()
    assert isinstance(e.value, AttngeomError)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------------------------
# heads_for and diff: positions and counts (attngeom.model.arguments)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [-1, 0, 2.7, True, "3"])
def test_defect_7_heads_for_top_must_be_a_count(trace, top):
    """``top=-1`` silently dropped the last row (a slice ``[:-1]``); 2.7 and True were taken as 2 and 1."""
    refused(lambda: trace.heads_for(-1, top=top), match="top must be a whole number")


@pytest.mark.parametrize("target", [2.7, True, np.float64(3.0), [1, True], [2, 3.5]])
def test_defect_7_heads_for_target_must_be_whole_positions(trace, target):
    """``heads_for(2.7)`` and ``heads_for(True)`` silently took positions 2 and 1."""
    refused(lambda: trace.heads_for(target), match="target must be a whole number")


def test_defect_7_diff_target_must_be_a_whole_position(trace):
    from attngeom.traces.compare import diff

    for target in (True, 2.7, "5"):
        refused(lambda: diff(trace, trace, target=target), match="target must be a whole number")


def test_whole_numbers_of_any_integer_type_are_taken(trace):
    """numpy integers are positions and counts like Python ints; None keeps its meaning (all rows)."""
    from attngeom.traces.compare import diff

    ref = trace.heads_for(5, top=4)
    assert ref.equals(trace.heads_for(np.int64(5), top=np.int32(4)))
    assert ref.equals(trace.heads_for(-len(trace) + 5, top=4))
    assert len(trace.heads_for(5, top=None)) > len(trace.heads_for(5, top=10)) == 10
    assert trace.heads_for(5, top=1).equals(ref.iloc[:1])
    assert diff(trace, trace, target=np.int64(4)).target_a == 4


@pytest.mark.parametrize("source, match", [("x", "source must be a whole number"), (2.5, "source must be a whole number"),
                                           (True, "source must be a whole number"), (99, "source 99 is outside")])
def test_defect_20_heads_for_source_is_a_position(trace, source, match):
    """``heads_for(source="x")`` raised a bare ValueError from ``int("x")``."""
    refused(lambda: trace.heads_for(-1, source=source), match=match)


@pytest.mark.parametrize("other", [None, "text", 3, [1, 2]])
def test_defect_20_diff_takes_two_traces(trace, other):
    """``diff(a, None)`` and ``diff(a, "text")`` raised AttributeError ('... has no attribute tokens')."""
    from attngeom.traces.compare import diff

    refused(lambda: diff(trace, other), match="diff compares two traces.*; b is")
    refused(lambda: diff(other, trace), match="diff compares two traces.*; a is")


@pytest.mark.parametrize("layers", [[0.5], [True], ["0"], [7]])
def test_heads_for_layers_are_layer_numbers_of_the_trace(trace, layers):
    refused(lambda: trace.heads_for(-1, layers=layers), match="layer")


# --------------------------------------------------------------------------------------------
# plot_token_map: the path and the width, checked before drawing
# --------------------------------------------------------------------------------------------


def test_defect_18_plot_token_map_paths_it_cannot_write(trace, tmp_path):
    """A missing folder, a directory, or a path the system refuses: one-line OutputError, no file."""
    refused(lambda: trace.plot_token_map(0, path=tmp_path / "no" / "map.png"), OutputError, "does not exist")
    refused(lambda: trace.plot_token_map(0, path=tmp_path), OutputError, "is a directory")
    refused(lambda: trace.plot_token_map(0, path="/proc/attngeom-map.png"), OutputError, "cannot write the figure")
    if os.geteuid() != 0:                         # root writes anywhere: only /proc refuses it
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        refused(lambda: trace.plot_token_map(0, path=locked / "map.png"), OutputError, "cannot write the figure")
        assert list(locked.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["locked"] if os.geteuid() != 0 else [])
    assert trace.plot_token_map(0, path=tmp_path / "map.pdf").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "locked") == ["map.pdf"]   # no temporary file


@pytest.mark.parametrize("path", [3, ["map.png"], b"map.png"])
def test_plot_token_map_path_is_a_file_name(trace, path):
    refused(lambda: trace.plot_token_map(0, path=path), match="path must be a file name")


@pytest.mark.parametrize("width", [0, -3, 1e5, float("nan"), float("inf"), "3", True, 1.0])
def test_defect_18_plot_token_map_width(trace, tmp_path, width):
    """``width`` 0 and -3 crashed in matplotlib, 1e5 asked for a 15-megapixel-wide image."""
    refused(lambda: trace.plot_token_map(0, width=width, path=tmp_path / "m.png"), match="width must be")
    assert list(tmp_path.iterdir()) == []


def test_plot_token_map_layer_head_tokens(trace):
    refused(lambda: trace.plot_token_map(True), match="layer must be a whole number")
    refused(lambda: trace.plot_token_map(0, head=1.5), match="head must be a whole number")
    refused(lambda: trace.plot_token_map(0, head=99), match="head 99 does not exist")
    refused(lambda: trace.plot_token_map(0, tokens=(0.5, 3)), match="tokens must be a whole number")
    refused(lambda: trace.plot_token_map(0, tokens=slice("a", 3)), match="tokens must be a whole number")
    refused(lambda: trace.plot_token_map(0, tokens=5), match=r"tokens must be a slice or \(start, stop\)")
    fig = trace.plot_token_map(0, tokens=(1, 4), width=3.3)
    assert fig.get_size_inches()[0] == pytest.approx(3.3)


# --------------------------------------------------------------------------------------------
# Trace.load: sizes before reading, tokens against ids
# --------------------------------------------------------------------------------------------


@pytest.fixture
def saved(trace, tmp_path):
    return trace.save(tmp_path / "t")


def _edit(path: Path, **changes) -> None:
    meta = json.loads((path / "trace.json").read_text())
    meta.update(changes)
    (path / "trace.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("path", [None, 3, ["t"]])
def test_trace_load_takes_a_path(path):
    from attngeom import Trace

    refused(lambda: Trace.load(path), match="Trace.load takes the directory of a saved trace")


def test_defect_6_edited_token_strings_or_ids_are_refused(saved):
    """A trace.json whose token strings or ids were edited (same count, tensors untouched) loaded."""
    from attngeom import Trace

    meta = json.loads((saved / "trace.json").read_text())
    _edit(saved, tokens=["X"] + meta["tokens"][1:])
    refused(lambda: Trace.load(saved), TraceFormatError, "the ids or tokens were changed after saving")
    _edit(saved, tokens=meta["tokens"], ids=[meta["ids"][0] + 1] + meta["ids"][1:])
    refused(lambda: Trace.load(saved), TraceFormatError, "the ids or tokens were changed after saving")
    _edit(saved, ids=meta["ids"], tokens=meta["tokens"][::-1])
    refused(lambda: Trace.load(saved), TraceFormatError, "the ids or tokens were changed after saving")
    _edit(saved, tokens=meta["tokens"])
    assert Trace.load(saved).tokens == meta["tokens"]
    del meta["tokens_sha256"]
    (saved / "trace.json").write_text(json.dumps(meta))
    refused(lambda: Trace.load(saved), TraceFormatError, "'tokens_sha256' is missing")


@pytest.mark.parametrize("big", [2**70, 2**63, 2**31])
def test_defect_19_ids_no_vocabulary_has_are_refused(saved, tmp_path, big):
    """ids of 2**70 loaded and ``to_html`` then crashed (OverflowError); also in a format-2 trace,
    which has no checksum of its ids."""
    from attngeom import Trace

    meta = json.loads((saved / "trace.json").read_text())
    for fmt in ("attngeom-trace-2", "attngeom-trace-3"):
        _edit(saved, format=fmt, ids=[big] + meta["ids"][1:])
        refused(lambda: Trace.load(saved), TraceFormatError, "beyond any vocabulary")
    _edit(saved, format="attngeom-trace-2", ids=meta["ids"])                # a format-2 trace still loads
    assert Trace.load(saved).to_html(tmp_path / "x.html").stat().st_size > 0


LOAD_UNDER_LIMIT = textwrap.dedent("""
    import re, resource, sys
    import safetensors, safetensors.torch, torch
    from attngeom import Trace
    from attngeom.errors import TraceFormatError

    used = int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (used + 2**30, used + 2**30))     # 1 GiB more than now
    try:
        Trace.load(sys.argv[1])
    except TraceFormatError as e:
        print("refused:", e)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and /proc/self/status are Linux's")
def test_defect_10_a_huge_tensor_file_is_refused_before_it_is_read(saved):
    """An 8 GiB (sparse) tensors.safetensors was read whole before any check (MemoryError); now its
    header is checked first. The load runs with 1 GiB of data memory to spare."""
    f = saved / "tensors.safetensors"
    f.unlink()
    with open(f, "wb") as out:
        out.truncate(8 * 2**30)                    # sparse: takes no disk
    r = subprocess.run([sys.executable, "-c", LOAD_UNDER_LIMIT, str(saved)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.startswith("refused:") and "tensors.safetensors is damaged" in r.stdout, \
        (r.stdout, r.stderr[-2000:])


def test_defect_10_sizes_are_checked_before_reading(saved, monkeypatch):
    """trace.json over its limit is not read; a tensor file larger than the machine's memory is not read."""
    from attngeom import Trace
    from attngeom.traces import saved as S

    monkeypatch.setattr(S, "META_MAX_BYTES", 100)
    refused(lambda: Trace.load(saved), TraceFormatError, "trace.json is .* MiB; a saved trace's is at most")
    monkeypatch.undo()
    monkeypatch.setattr(S, "_memory", lambda: 1000)
    refused(lambda: Trace.load(saved), TraceFormatError, "more than this machine's .* of memory")


def test_a_tensor_header_that_does_not_fit_trace_json_is_refused_before_reading(saved, monkeypatch):
    """Shapes come from the header: a file whose attention is [H, 50000, 50000] is refused without
    reading its data (load_file is never called)."""
    import safetensors.torch

    from attngeom import Trace

    header = json.dumps({"0.a": {"dtype": "F32", "shape": [4, 50000, 50000], "data_offsets": [0, 4 * 50000 ** 2 * 4]}})
    header += " " * (-len(header) % 8)
    f = saved / "tensors.safetensors"
    with open(f, "wb") as out:
        out.write(len(header).to_bytes(8, "little") + header.encode())
        out.truncate(8 + len(header) + 4 * 50000 ** 2 * 4)
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("the tensors were read"))
    refused(lambda: Trace.load(saved), TraceFormatError, "layer 0 has no 'v' tensor|attention covers 50000 tokens")


# --------------------------------------------------------------------------------------------
# compressed_generate: checked before the prefill
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if compressed_generate reaches its prefill."""
    from attngeom.kvcache import prefill as P

    monkeypatch.setattr(P, "prefill", lambda *a, **k: pytest.fail("compute started before the arguments were checked"))


@pytest.mark.parametrize("new", [10**9, 250])
def test_defect_9_max_new_tokens_past_the_context_is_refused_before_allocating(handle, no_compute, new):
    """``max_new_tokens=10**9`` sized the compressed cache for 10**9 more tokens up front (~24 GB on
    SmolLM2); the tiny model reads 256 positions."""
    from attngeom.kvcache.generate import compressed_generate

    refused(lambda: compressed_generate(handle, [5] * 10, [6] * 3, "window", 0.5, max_new_tokens=new),
            match=r"compressed_generate \(context 10 \+ question 3 \+ max_new_tokens \d+\) needs \d+ positions but "
                  r".* handles at most 256 positions")


@pytest.mark.parametrize("new", [0, -1, 2.5, True, "4"])
def test_max_new_tokens_is_a_count(handle, no_compute, new):
    from attngeom.kvcache.generate import compressed_generate

    refused(lambda: compressed_generate(handle, [5] * 10, [6], "window", 0.5, max_new_tokens=new),
            match="max_new_tokens must be a whole number")


@pytest.mark.parametrize("context, question, match", [
    ([], [6], "the context is empty"),
    ([5] * 10 + [10**6], [6], "token id 1000000 is outside the model's vocabulary"),
    ([5] * 10, [6, 2**70], "is outside the model's vocabulary"),
    ([5] * 10, [-1], "token id -1 is outside the model's vocabulary"),
    ([5, True, 5], [6], "a token id must be a whole number, not True"),
    ([5, 2.5], [6], "a token id must be a whole number"),
    ("The capital of France is", [6], "the context is text; compressed_generate takes token ids"),  # issue 51
    ([5] * 10, "is", "the question is text"),
])
def test_defect_11_compressed_generate_context_and_ids(handle, no_compute, context, question, match):
    """An empty context raised torch's RuntimeError ('indices ... FloatTensor'); an id beyond the
    vocabulary an IndexError from the embedding."""
    from attngeom.kvcache.generate import compressed_generate

    refused(lambda: compressed_generate(handle, context, question, "window", 0.5, max_new_tokens=2), match=match)


@pytest.mark.parametrize("ratio", [1.0, -0.1, "0.5", True, float("nan")])
def test_compressed_generate_ratio(handle, no_compute, ratio):
    from attngeom.kvcache.generate import compressed_generate

    refused(lambda: compressed_generate(handle, [5] * 10, [6], "window", ratio, max_new_tokens=2), match="ratio")


def test_compressed_generate_still_answers(handle):
    """Good arguments (numpy ids among them) decode as before: the full cache's answer equals generate's."""
    import torch

    from attngeom.kvcache.generate import compressed_generate

    ctx, q = [5, 9, 17, 33, 2, 8, 40, 41, 7, 11], [6, 12]
    out = compressed_generate(handle, np.array(ctx), q, "window", 0.0, max_new_tokens=3, do_sample=False)
    ids = torch.tensor([ctx + q])
    want = handle.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.tolist() == want.tolist()
