"""Saved traces: :meth:`attngeom.traces.trace.Trace.save` and :meth:`~attngeom.traces.trace.Trace.load` (docs/explore.md).

A saved trace is a directory with ``trace.json`` (ids, tokens, layers, format, the tensor file's
SHA-256; written last) and ``tensors.safetensors`` (per layer the attention, the values and the
per-token head-space quantities every metric is computed from, or with ``weights=True`` ``G`` and
``W_O``). Loading checks everything before use and raises :class:`~attngeom.errors.TraceFormatError`
with one line.

What belongs here: the file format, its writing and its validation. Not here: the ``Trace`` and
``LayerTrace`` classes and their metrics (:mod:`attngeom.traces.trace`), which call these functions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from attngeom.capture.blocks import Block, LayerState
from attngeom.errors import InputError, OutputError, TraceFormatError
from attngeom.runs.storage import JSONDepthError, parse_json


TRACE_FORMAT = "attngeom-trace-2"
"""Version 2: weight-less by default, checksum in ``trace.json``. Version 1 (always with weights,
no checksum) is still read."""
TRACE_META, TRACE_TENSORS = "trace.json", "tensors.safetensors"
_PIECES = ("a", "v", "value_norm", "uG", "p")      # weight-less
_WEIGHTED = ("a", "v", "G", "w_o")                 # weights=True, and format 1
_ROW_TOL = 1e-2                                    # attention row sums (bf16 models stay well inside)


def _layer_tensors(lt, weights: bool) -> dict[str, torch.Tensor]:
    sink = {} if lt.learned_sink is None else {"sink": lt.learned_sink}
    if weights:
        return {"a": lt.a, "v": lt.v, "G": lt.G, "w_o": lt.w_o, **sink}
    blk = lt.block
    return {"a": lt.a, "v": lt.v, "value_norm": blk.value_norm[0], "uG": blk.uG[0], "p": blk.pulled_back[0], **sink}


def _frozen_layer(layer_cls, index: int, t: dict[str, torch.Tensor]):
    """A :class:`LayerTrace` of a weight-less trace: its block is seeded with the saved per-token
    quantities, so every metric is computed by the same :class:`Block` code as before saving."""
    a, v = t["a"], t["v"]
    H, T = a.shape[0], a.shape[-1]
    lt = layer_cls(index=index, a=a, v=v, G=None, w_o=None, learned_sink=t.get("sink"))
    state = LayerState(layer=index, module=None, value=v[None], w_o=None, G=None, G_full=None,
                       kv_head=torch.arange(H), lengths=torch.tensor([T]))
    state.__dict__["value_norm"] = t["value_norm"][None]        # LayerState.value_norm is cached
    block = Block(state=state, a=a[None], q_start=0, k_start=0, learned_sink=lt._sink())
    block._cache.update(uG=t["uG"][None], p=t["p"][None])
    lt.__dict__["block"] = block                                  # LayerTrace.block is cached
    return lt


def load_trace(path: Path, cls, layer_cls):
    """Read a trace written by :func:`save_trace` as ``cls`` with layers ``layer_cls``
    (:meth:`attngeom.traces.trace.Trace.load`: every check, one-line :class:`TraceFormatError`)."""

    def bad(msg: str) -> TraceFormatError:
        return TraceFormatError(f"{path}: {msg}")

    if not path.is_dir():
        raise bad("not a saved trace (no such directory)" if not path.exists() else "not a directory")
    meta_file, tensor_file = path / TRACE_META, path / TRACE_TENSORS
    for f in (meta_file, tensor_file):
        if not f.is_file():
            raise bad(f"{f.name} is missing; a saved trace holds {TRACE_META} and {TRACE_TENSORS}")
    try:
        meta = parse_json(meta_file.read_bytes())
    except JSONDepthError as e:
        raise bad(f"{TRACE_META}: {e}") from None
    except ValueError:    # not UTF-8, not JSON
        raise bad(f"{TRACE_META} is not valid JSON") from None
    if not isinstance(meta, dict):
        raise bad(f"{TRACE_META} does not hold a JSON object")
    fmt = meta.get("format")
    if fmt not in ("attngeom-trace-1", TRACE_FORMAT):
        raise bad(f"unknown trace format {fmt!r} (this attngeom reads attngeom-trace-1 and {TRACE_FORMAT})")
    ids, tokens, layers = meta.get("ids"), meta.get("tokens"), meta.get("layers")
    name = meta.get("model_name", "")
    weights = True if fmt == "attngeom-trace-1" else meta.get("weights")
    checksum = meta.get("tensors_sha256") if fmt == TRACE_FORMAT else None

    def int_list(x) -> bool:
        return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)

    if not int_list(ids) or not ids:
        raise bad(f"{TRACE_META}: 'ids' must be a non-empty list of token ids")
    if not isinstance(tokens, list) or not all(isinstance(s, str) for s in tokens):
        raise bad(f"{TRACE_META}: 'tokens' must be a list of strings")
    if len(tokens) != len(ids):
        raise bad(f"{TRACE_META} has {len(ids)} ids but {len(tokens)} tokens")
    if not int_list(layers) or len(set(layers)) != len(layers):
        raise bad(f"{TRACE_META}: 'layers' must be a list of distinct layer numbers")
    if not isinstance(name, str) or not isinstance(weights, bool):
        raise bad(f"{TRACE_META}: 'model_name' must be a string and 'weights' true or false")
    if fmt == TRACE_FORMAT and not isinstance(checksum, str):
        raise bad(f"{TRACE_META}: 'tensors_sha256' is missing")
    prompt_length = meta.get("prompt_length")
    if prompt_length is not None and not (isinstance(prompt_length, int) and not isinstance(prompt_length, bool)
                                          and 1 <= prompt_length <= len(ids)):
        raise bad(f"{TRACE_META}: 'prompt_length' must be a number of tokens from 1 to {len(ids)}")
    marks = {k: meta.get(k, []) for k in ("special", "template")}        # optional: positions
    for k, x in marks.items():
        if not int_list(x) or any(p >= len(ids) for p in x):
            raise bad(f"{TRACE_META}: {k!r} must be a list of positions below {len(ids)}")

    from safetensors.torch import load as load_bytes

    data = tensor_file.read_bytes()
    try:
        t = load_bytes(data)
    except Exception as e:  # safetensors raises its own errors (and others) on damaged headers
        raise bad(f"{TRACE_TENSORS} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
                  ) from None
    kinds = _WEIGHTED if weights else _PIECES
    expected = {f"{i}.{k}" for i in layers for k in kinds}
    missing = [(i, k) for i in layers for k in kinds if f"{i}.{k}" not in t]
    if missing:
        raise bad(f"layer {missing[0][0]} has no {missing[0][1]!r} tensor")
    expected |= {f"{i}.sink" for i in layers if f"{i}.sink" in t}       # learned sink shares (optional)
    if set(t) - expected:
        raise bad(f"{TRACE_TENSORS} holds an unexpected tensor {sorted(set(t) - expected)[0]!r}")
    T = len(ids)
    out = []
    for i in layers:
        lt = {}
        for k in kinds + (("sink",) if f"{i}.sink" in t else ()):
            x = t[f"{i}.{k}"]
            if x.dtype != torch.float32:
                raise bad(f"layer {i}: {k!r} is {str(x.dtype).replace('torch.', '')}, expected float32")
            lt[k] = x
        a, v = lt["a"], lt["v"]
        if a.ndim != 3 or a.shape[1] != a.shape[2]:
            raise bad(f"layer {i}: attention has shape {list(a.shape)}, expected [heads, T, T]")
        if a.shape[-1] != T:
            raise bad(f"layer {i}: attention covers {a.shape[-1]} tokens but {TRACE_META} has {T}")
        H = a.shape[0]
        if v.ndim != 3 or tuple(v.shape[:2]) != (H, T):
            raise bad(f"layer {i}: 'v' has shape {list(v.shape)}, expected [{H}, {T}, head_dim]")
        d = v.shape[2]
        shapes = ({"G": (H, d, d)} if weights else {"value_norm": (H, T), "uG": (H, T, d), "p": (H, T, d)})
        shapes.update({"sink": (H, T)} if "sink" in lt else {})
        for k, shape in shapes.items():
            if tuple(lt[k].shape) != shape:
                raise bad(f"layer {i}: {k!r} has shape {list(lt[k].shape)}, expected {list(shape)}")
        if weights and (lt["w_o"].ndim != 2 or lt["w_o"].shape[1] != H * d):
            raise bad(f"layer {i}: 'w_o' has shape {list(lt['w_o'].shape)}, expected [D, {H * d}]")
        for k, x in lt.items():
            if not bool(torch.isfinite(x).all()):
                raise bad(f"layer {i}: {k!r} holds non-finite values (NaN or inf)")
        above = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        if bool((a < -_ROW_TOL).any()) or bool((a[:, above].abs() > _ROW_TOL).any()):
            raise bad(f"layer {i}: attention is not causal probabilities (negative, or weight on later tokens)")
        sink = lt["sink"].double() if "sink" in lt else 0.0            # a learned sink takes the rest of a row
        if "sink" in lt and bool(((lt["sink"] < -_ROW_TOL) | (lt["sink"] > 1 + _ROW_TOL)).any()):
            raise bad(f"layer {i}: 'sink' holds shares outside [0, 1]")
        err = (a.double().sum(-1) + sink - 1).abs()
        if bool((err > _ROW_TOL).any()):
            h, q = divmod(int(err.argmax()), T)
            total = float(a[h, q].double().sum()) + (float(lt["sink"][h, q]) if "sink" in lt else 0.0)
            raise bad(f"layer {i}: attention row (head {h}, query {q}) sums to {total:.6g}, not 1")
        if not weights and bool((lt["value_norm"] < 0).any()):
            raise bad(f"layer {i}: 'value_norm' holds negative norms")
        out.append(layer_cls(index=i, a=a, v=v, G=lt["G"], w_o=lt["w_o"], learned_sink=lt.get("sink")) if weights
                   else _frozen_layer(layer_cls, i, lt))
    if checksum is not None and hashlib.sha256(data).hexdigest() != checksum:
        raise bad(f"{TRACE_TENSORS} does not match the checksum in {TRACE_META} (changed or damaged)")
    return cls(ids=ids, tokens=tokens, layers=out, model_name=name, prompt_length=prompt_length,
               special=tuple(marks["special"]), template=tuple(marks["template"]))


def save_trace(trace, path: Path, weights: bool = False) -> Path:
    """Write ``trace`` to the directory ``path`` (:meth:`attngeom.traces.trace.Trace.save`)."""
    from safetensors.torch import save as save_bytes

    from attngeom.runs.storage import atomic_write_bytes

    if weights and any(lt.w_o is None or lt.G is None for lt in trace.layers):
        raise InputError("this trace was saved without weights; it cannot be saved with weights=True")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the trace directory {path}: {e.strerror or e}") from None
    tensors = {}
    for lt in trace.layers:
        for k, x in _layer_tensors(lt, weights).items():
            tensors[f"{lt.index}.{k}"] = x.detach().to("cpu", torch.float32).contiguous()
    data = save_bytes(tensors)
    atomic_write_bytes(path / TRACE_TENSORS, data)
    meta = {"format": TRACE_FORMAT, "ids": [int(i) for i in trace.ids], "tokens": list(trace.tokens),
            "model_name": trace.model_name, "layers": [int(lt.index) for lt in trace.layers],
            "weights": bool(weights), "tensors_sha256": hashlib.sha256(data).hexdigest(),
            **({} if trace.prompt_length is None else {"prompt_length": int(trace.prompt_length)}),
            "special": [int(p) for p in trace.special], "template": [int(p) for p in trace.template]}
    atomic_write_bytes(path / TRACE_META, json.dumps(meta).encode("utf-8"))
    return path
