"""Streaming reducers agree with full traces; traces save and reload; bad input is refused."""

import json

import numpy as np
import pytest
import torch

from attngeom.errors import InputError, TraceFormatError
from attngeom.streaming.reducers import HeadStats, TokenStats
from attngeom.traces.trace import Trace, analyze
from attngeom.streaming import stream
from checks import assert_same_trace
from tiny_models import tiny_model

TEXTS = ["a b c d e f g h i j k l m n", "the cat sat on the mat while the dog slept", "x y z"]


@pytest.fixture(scope="module")
def handle():
    return tiny_model("qwen2")


def test_stream_matches_full_traces(handle):
    heads, tokens = HeadStats(), TokenStats()
    stream(handle, TEXTS, [heads, tokens], batch_size=2, progress=False, block_elements=100)
    traces = [analyze(handle, t) for t in TEXTS]
    hs = heads.result()
    ts = tokens.result()
    L = len(traces[0].layers)
    for layer in range(L):
        # per-head means over queries i > 0 of all texts
        sink = np.concatenate([tr.layers[layer].attention[:, 1:, 0] for tr in traces], axis=1).mean(1)
        ent = np.concatenate([
            -(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0)).sum(-1)[:, 1:]
            for a in (tr.layers[layer].attention for tr in traces)], axis=1).mean(1)
        c0 = np.concatenate([tr.layers[layer].contribution[:, 1:, 0] for tr in traces], axis=1).mean(1)
        sub = hs[hs.layer == layer].sort_values("head")
        assert np.allclose(sub.sink_rate, sink, atol=1e-5)
        assert np.allclose(sub.entropy, ent, atol=1e-4)
        assert np.allclose(sub.sink_contribution, c0, atol=1e-5)
        assert np.allclose(sub.winner_self + sub.winner_sink + sub.winner_other, 1)
        for k, tr in enumerate(traces):
            lt = tr.layers[layer]
            n = len(tr)
            rows = ts[(ts.text == k) & (ts.layer == layer)].sort_values("position")
            assert len(rows) == n
            for m in ("attention", "value_weighted", "output_normalized", "contribution"):
                score = lt.token_score(m)                             # [T, T]
                expected = score.sum(0) / (n - np.arange(n))          # mean over queries i >= j
                assert np.allclose(rows[f"{m}_received"], expected, atol=1e-5), m
            assert np.allclose(rows.sink_rate, lt.attention[:, :, 0].mean(0), atol=1e-6)
            assert np.allclose(rows.output_norm, lt.output_norm, rtol=1e-5)


@pytest.mark.parametrize("weights", [False, True])
def test_trace_save_and_load(handle, tmp_path, weights):
    tr = analyze(handle, TEXTS[1])
    tr.save(tmp_path / "t", weights=weights)
    back = Trace.load(tmp_path / "t")
    assert_same_trace(tr, back)
    assert (back.layers[0].w_o is None) == (not weights)
    # a reloaded trace saves again (weight-less from either kind)
    back.save(tmp_path / "again")
    assert_same_trace(tr, Trace.load(tmp_path / "again"))
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["tensors.safetensors", "trace.json"]


def test_weightless_trace_refuses_weights(handle, tmp_path):
    analyze(handle, TEXTS[2]).save(tmp_path / "t")
    with pytest.raises(InputError, match="without weights"):
        Trace.load(tmp_path / "t").save(tmp_path / "w", weights=True)


def test_traces_store_no_weights_unless_asked(handle, tmp_path):
    """A trace holds no per-layer W_O or G unless asked (``weights=True``): with them a 10-token trace
    of SmolLM2-135M is about 45 MB."""
    tr = analyze(handle, TEXTS[1])
    small, big = tr.save(tmp_path / "small"), tr.save(tmp_path / "big", weights=True)
    names = set(safetensors_keys(small / "tensors.safetensors"))
    assert not any(k.endswith((".G", ".w_o")) for k in names)
    assert {k.split(".", 1)[1] for k in names} == {"a", "v", "value_norm", "uG", "p"}
    H, T = tr.layers[0].a.shape[:2]
    d = tr.layers[0].v.shape[-1]
    per_layer = 4 * (H * T * T + 3 * H * T * d + H * T)
    size = (small / "tensors.safetensors").stat().st_size
    assert size < len(tr.layers) * per_layer + 4096            # tensors of the tokens, nothing else
    assert json.loads((small / "trace.json").read_text())["weights"] is False
    assert json.loads((big / "trace.json").read_text())["weights"] is True


def test_format_1_traces_still_load(handle, tmp_path):
    """Traces written before the format change (always with weights, no checksum)."""
    from safetensors.torch import save_file

    tr = analyze(handle, TEXTS[2])
    d = tmp_path / "v1"
    d.mkdir()
    save_file({f"{lt.index}.{k}": getattr(lt, k).contiguous() for lt in tr.layers for k in ("a", "v", "G", "w_o")},
              str(d / "tensors.safetensors"))
    (d / "trace.json").write_text(json.dumps({"ids": tr.ids, "tokens": tr.tokens, "model_name": tr.model_name,
                                              "layers": [lt.index for lt in tr.layers],
                                              "format": "attngeom-trace-1"}))
    assert_same_trace(tr, Trace.load(d))


# ---- damaged traces: every one raises TraceFormatError with a one-line message ----------------


def safetensors_keys(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


@pytest.fixture
def saved(handle, tmp_path):
    return analyze(handle, TEXTS[1]).save(tmp_path / "t")


def rewrite(path, edit, checksum=True):
    """Change the tensors of a saved trace with ``edit(dict)``; keep the checksum consistent so
    the check under test, not the checksum, is what fires."""
    import hashlib

    from safetensors.torch import load_file, save

    t = load_file(str(path / "tensors.safetensors"))
    edit(t)
    data = save(t)
    (path / "tensors.safetensors").write_bytes(data)
    if checksum:
        meta = json.loads((path / "trace.json").read_text())
        meta["tensors_sha256"] = hashlib.sha256(data).hexdigest()
        (path / "trace.json").write_text(json.dumps(meta))


def edit_meta(path, sign=True, **changes):
    """Change ``trace.json``; ``sign``: keep its ids-and-tokens checksum consistent (where they are
    lists it can be computed of) so the check under test, not the checksum, is what fires."""
    from attngeom.traces.saved import tokens_sha256

    meta = json.loads((path / "trace.json").read_text())
    meta.update(changes)
    if sign:
        try:
            meta["tokens_sha256"] = tokens_sha256(meta["ids"], meta["tokens"])
        except (TypeError, ValueError):
            pass
    (path / "trace.json").write_text(json.dumps(meta))


def assert_refused(path, match):
    with pytest.raises(TraceFormatError, match=match) as e:
        Trace.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    return str(e.value)


def test_missing_files_refused(saved, tmp_path):
    assert_refused(tmp_path / "nowhere", "no such directory")
    (tmp_path / "file").write_text("x")
    assert_refused(tmp_path / "file", "not a directory")
    (saved / "tensors.safetensors").rename(tmp_path / "moved")
    assert_refused(saved, "tensors.safetensors is missing")
    (saved / "trace.json").unlink()
    assert_refused(saved, "trace.json is missing")


@pytest.mark.parametrize("content, match", [
    (b"\x89PNG\xff\xfe random", "not valid JSON"),
    (b"[1, 2, 3]", "JSON object"),
    (b'{"format": "attngeom-trace-9"}', "unknown trace format 'attngeom-trace-9'"),
    (b"{}", "unknown trace format None"),
])
def test_wrong_json_refused(saved, content, match):
    (saved / "trace.json").write_bytes(content)
    assert_refused(saved, match)


def test_wrong_metadata_refused(saved):
    meta = json.loads((saved / "trace.json").read_text())
    edit_meta(saved, tokens=meta["tokens"][:-1])
    assert_refused(saved, r"has \d+ ids but \d+ tokens")
    edit_meta(saved, tokens=meta["tokens"][:-1], ids=meta["ids"][:-1])          # consistent, but not the tensors
    assert_refused(saved, r"layer 0: attention covers (\d+) tokens but trace.json has (?!\1)\d+")
    edit_meta(saved, tokens=meta["tokens"], ids=meta["ids"], layers=[0, 0])
    assert_refused(saved, "distinct layer numbers")
    edit_meta(saved, layers=[0, 7])
    assert_refused(saved, "layer 7 has no 'a' tensor")
    edit_meta(saved, layers=[0])
    assert_refused(saved, "unexpected tensor '1.a'")
    edit_meta(saved, layers=meta["layers"], ids=["x"] * len(meta["ids"]))
    assert_refused(saved, "'ids' must be")
    edit_meta(saved, ids=meta["ids"], tokens=[1] * len(meta["ids"]))
    assert_refused(saved, "'tokens' must be")
    edit_meta(saved, tokens=meta["tokens"], weights="yes")
    assert_refused(saved, "'weights' true or false")
    edit_meta(saved, weights=True)                                   # says weights, holds none
    assert_refused(saved, "has no 'G' tensor")


def test_random_bytes_in_a_tensor_refused(saved):
    """Bytes overwritten inside the attention tensor's payload (the header stays readable)."""
    f = saved / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:header])["0.a"]["data_offsets"]
    rng = np.random.default_rng(0)
    data[header + start: header + end] = rng.integers(0, 256, end - start, dtype=np.uint8).tobytes()
    f.write_bytes(bytes(data))
    assert_refused(saved, "layer 0: (attention|'a' holds non-finite)")


def test_random_bytes_where_values_stay_plausible_fail_the_checksum(saved):
    f = saved / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8:header])["1.v"]["data_offsets"]
    data[header + start: header + start + 4] = np.float32(0.5).tobytes()       # one finite value changed
    f.write_bytes(bytes(data))
    assert_refused(saved, "does not match the checksum")


@pytest.mark.parametrize("damage", ["truncated", "header", "empty"])
def test_structurally_damaged_tensor_file_refused(saved, damage):
    f = saved / "tensors.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "header": b"\xff" * 16 + data[16:], "empty": b""}[damage])
    assert_refused(saved, "tensors.safetensors is damaged")


@pytest.mark.parametrize("key, cut, match", [
    ("0.v", (slice(None), slice(None), slice(0, -1)), r"layer 0: 'uG' has shape \[\d+, \d+, \d+\], expected"),
    ("1.a", (slice(None), slice(0, -1)), "layer 1: attention has shape"),
    ("0.a", (slice(0, -1),), "layer 0: 'v' has shape"),
    ("1.value_norm", (slice(None), slice(0, -1)), "layer 1: 'value_norm' has shape"),
])
def test_wrong_shape_refused(saved, key, cut, match):
    rewrite(saved, lambda t: t.update({key: t[key][cut].contiguous()}))
    assert_refused(saved, match)


def test_wrong_dtype_refused(saved):
    rewrite(saved, lambda t: t.update({"1.p": t["1.p"].double()}))
    assert_refused(saved, "layer 1: 'p' is float64, expected float32")


def test_nan_rows_refused(saved):
    def nan_row(t):
        t["1.a"][1, 4] = float("nan")
    rewrite(saved, nan_row)
    assert_refused(saved, "layer 1: 'a' holds non-finite values")


def test_rows_not_summing_to_one_refused(saved):
    def halve(t):
        t["1.a"][3, 5] *= 0.5
    rewrite(saved, halve)
    assert_refused(saved, r"layer 1: attention row \(head 3, query 5\) sums to 0.5")

    def future(t):
        t["0.a"][0, 2, 7] = 0.5
    rewrite(saved, future)
    assert_refused(saved, "layer 0: attention is not causal probabilities")


def test_checksum_missing_refused(saved):
    meta = json.loads((saved / "trace.json").read_text())
    del meta["tensors_sha256"]
    (saved / "trace.json").write_text(json.dumps(meta))
    assert_refused(saved, "'tensors_sha256' is missing")


def test_tokens_are_strings(handle):
    tr = analyze(handle, "hello world")
    assert len(tr.tokens) == len(tr.ids) and all(isinstance(t, str) for t in tr.tokens)
    assert tr.layers[0].contribution.dtype == np.float32
    H = handle.model.config.num_attention_heads
    assert tr.layers[0].contribution.shape == (H, len(tr), len(tr))
    assert tr.layers[0].head_output_norm.shape == (H, len(tr))


@pytest.mark.parametrize("bad", ["", "   \n", []])
def test_empty_input_refused(handle, bad):
    with pytest.raises(InputError):
        analyze(handle, bad)


def test_too_long_input_refused(handle):
    limit = handle.max_positions
    with pytest.raises(InputError, match="at most"):
        analyze(handle, torch.ones(limit + 1, dtype=torch.long))


def test_token_id_outside_vocab_refused(handle):
    with pytest.raises(InputError, match="vocabulary"):
        analyze(handle, [1, 2, 10**6])


def test_save_into_a_file_path_is_an_output_error(handle, tmp_path):
    from attngeom.errors import OutputError

    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="cannot create the trace directory"):
        analyze(handle, TEXTS[2]).save(tmp_path / "f")


@pytest.mark.parametrize("chunk", [1, 7 * 50, 1 << 20])
def test_token_nll_in_chunks_equals_one_log_softmax(monkeypatch, chunk):
    """The chunked NLL gives exactly the values of one log-softmax over all positions, padding 0."""
    from attngeom.streaming import passes as TR
    from attngeom.streaming.reducers import InputBatch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 50, generator=g) * 4
    ids = torch.randint(0, 50, (3, 9), generator=g)
    batch = InputBatch(ids=ids, lengths=torch.tensor([9, 5, 1]), index=[0, 1, 2])
    monkeypatch.setattr(TR, "NLL_CHUNK_ELEMENTS", chunk)
    got = TR.token_nll(logits, batch)
    ref = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref[1, 4:] = 0
    ref[2, :] = 0
    assert torch.equal(got, ref)
