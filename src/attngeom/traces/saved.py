"""Saved traces: :meth:`attngeom.traces.trace.Trace.save` and :meth:`~attngeom.traces.trace.Trace.load` (docs/explore.md).

A saved trace is a directory with ``trace.json`` (ids, tokens, layers, format, the SHA-256 of the
ids and tokens and of the tensor file; written last) and ``tensors.safetensors`` (per layer the
attention, the values and the per-token head-space quantities every metric is computed from, or with
``weights=True`` ``G`` and ``W_O``). Loading checks everything before use and raises
:class:`~attngeom.errors.TraceFormatError` with one line; sizes come first: ``trace.json`` is read only
if it is at most :data:`META_MAX_BYTES`, and the tensor file's header (names, dtypes, shapes, the
file's size) is checked against ``trace.json`` and the memory available before any tensor is read.

What belongs here: the file format, its writing and its validation. Not here: the ``Trace`` and
``LayerTrace`` classes and their metrics (:mod:`attngeom.traces.trace`), which call these functions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from attngeom.capture.blocks import Block, LayerState
from attngeom.errors import InputError, OutputError, TraceFormatError
from attngeom.runs.storage import JSONDepthError, parse_json


TRACE_FORMAT = "attngeom-trace-3"
"""Version 3: ``trace.json`` also records the SHA-256 of its ids and tokens (``tokens_sha256``).
Version 2 (weight-less by default, the tensor file's checksum in ``trace.json``) and version 1 (always
with weights, no checksum) are still read."""
FORMATS = ("attngeom-trace-1", "attngeom-trace-2", TRACE_FORMAT)
META_MAX_BYTES = 256 * 2**20
"""The largest ``trace.json`` read (a trace of 100,000 tokens writes ~3 MB)."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are below this (the largest vocabularies hold ~260,000 tokens)."""
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


def tokens_sha256(ids, tokens) -> str:
    """The SHA-256 of a trace's ids and token strings, as ``trace.json`` records it."""
    text = json.dumps({"ids": [int(i) for i in ids], "tokens": list(tokens)}, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _memory() -> int | None:
    """The machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - systems without sysconf
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


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
    size = meta_file.stat().st_size
    if size > META_MAX_BYTES:
        raise bad(f"{TRACE_META} is {size / 2**20:.0f} MiB; a saved trace's is at most {META_MAX_BYTES // 2**20} MiB")
    try:
        meta = parse_json(meta_file.read_bytes())
    except JSONDepthError as e:
        raise bad(f"{TRACE_META}: {e}") from None
    except ValueError:    # not UTF-8, not JSON
        raise bad(f"{TRACE_META} is not valid JSON") from None
    if not isinstance(meta, dict):
        raise bad(f"{TRACE_META} does not hold a JSON object")
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise bad(f"unknown trace format {repr(fmt)[:60]} (this attngeom reads {', '.join(FORMATS)})")
    ids, tokens, layers = meta.get("ids"), meta.get("tokens"), meta.get("layers")
    name = meta.get("model_name", "")
    weights = True if fmt == "attngeom-trace-1" else meta.get("weights")
    checksum = meta.get("tensors_sha256") if fmt != "attngeom-trace-1" else None

    def int_list(x) -> bool:
        return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)

    if not int_list(ids) or not ids:
        raise bad(f"{TRACE_META}: 'ids' must be a non-empty list of token ids")
    if max(ids) > MAX_TOKEN_ID:
        raise bad(f"{TRACE_META}: 'ids' holds {max(ids)}, beyond any vocabulary (token ids are 0 to {MAX_TOKEN_ID})"[:300])
    if not isinstance(tokens, list) or not all(isinstance(s, str) for s in tokens):
        raise bad(f"{TRACE_META}: 'tokens' must be a list of strings")
    if len(tokens) != len(ids):
        raise bad(f"{TRACE_META} has {len(ids)} ids but {len(tokens)} tokens")
    if fmt == TRACE_FORMAT and meta.get("tokens_sha256") != tokens_sha256(ids, tokens):
        raise bad(f"{TRACE_META}: the ids or tokens were changed after saving (they do not match its "
                  "'tokens_sha256')" if isinstance(meta.get("tokens_sha256"), str)
                  else f"{TRACE_META}: 'tokens_sha256' is missing")
    if not int_list(layers) or len(set(layers)) != len(layers):
        raise bad(f"{TRACE_META}: 'layers' must be a list of distinct layer numbers")
    if not isinstance(name, str) or not isinstance(weights, bool):
        raise bad(f"{TRACE_META}: 'model_name' must be a string and 'weights' true or false")
    if fmt != "attngeom-trace-1" and not isinstance(checksum, str):
        raise bad(f"{TRACE_META}: 'tensors_sha256' is missing")
    prompt_length = meta.get("prompt_length")
    if prompt_length is not None and not (isinstance(prompt_length, int) and not isinstance(prompt_length, bool)
                                          and 1 <= prompt_length <= len(ids)):
        raise bad(f"{TRACE_META}: 'prompt_length' must be a number of tokens from 1 to {len(ids)}")
    marks = {k: meta.get(k, []) for k in ("special", "template")}        # optional: positions
    for k, x in marks.items():
        if not int_list(x) or any(p >= len(ids) for p in x):
            raise bad(f"{TRACE_META}: {k!r} must be a list of positions below {len(ids)}")

    kinds = _WEIGHTED if weights else _PIECES
    header = _read_header(tensor_file, bad)
    _check_header(header, layers, kinds, weights, len(ids), bad)
    size, memory = tensor_file.stat().st_size, _memory()
    if memory is not None and size > memory:
        raise bad(f"{TRACE_TENSORS} is {_gib(size)}, more than this machine's {_gib(memory)} of memory")
    from safetensors.torch import load_file

    try:
        t = load_file(str(tensor_file))
    except Exception as e:  # safetensors raises its own errors (and others) on damaged files
        raise bad(f"{TRACE_TENSORS} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
                  ) from None
    T = len(ids)
    out = []
    for i in layers:
        lt = {k: t[f"{i}.{k}"] for k in kinds + (("sink",) if f"{i}.sink" in t else ())}
        a, v = lt["a"], lt["v"]
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
    if checksum is not None and _file_sha256(tensor_file) != checksum:
        raise bad(f"{TRACE_TENSORS} does not match the checksum in {TRACE_META} (changed or damaged)")
    return cls(ids=ids, tokens=tokens, layers=out, model_name=name, prompt_length=prompt_length,
               special=tuple(marks["special"]), template=tuple(marks["template"]))


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_HEADER_MAX_BYTES = 100_000_000                   # safetensors' own limit


def _read_header(path: Path, bad) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from the header of the safetensors file ``path`` (an 8-byte length,
    then JSON), reading nothing else: the header must describe tensors whose bytes fill the rest of
    the file exactly (so the file's size is what the names, dtypes and shapes say)."""
    size = path.stat().st_size

    def damaged(why: str) -> TraceFormatError:
        return bad(f"{TRACE_TENSORS} is damaged ({why})")

    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, _HEADER_MAX_BYTES):
            raise damaged(f"its header length does not fit a file of {size} bytes")
        raw = f.read(n)
    try:
        header = parse_json(raw)
    except (ValueError, JSONDepthError):
        raise damaged("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    header.pop("__metadata__", None)
    out, spans = {}, []
    for name, e in header.items():
        shape = e.get("shape") if isinstance(e, dict) else None
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if (not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
                or e.get("dtype") not in _ITEM_BYTES):
            raise damaged(f"tensor {name[:40]!r} has no dtype, shape and data offsets")
        nbytes = _ITEM_BYTES[e["dtype"]]
        for x in shape:
            nbytes *= x
        if offsets[1] - offsets[0] != nbytes:
            raise damaged(f"tensor {name[:40]!r} of shape {shape} does not take {offsets[1] - offsets[0]} bytes")
        out[name] = (e["dtype"], tuple(shape))
        spans.append(tuple(offsets))
    end = 0
    for b, e in sorted(spans):
        if b != end:
            break
        end = e
    if end != size - 8 - n:
        raise damaged(f"its tensors do not fill the file's {size - 8 - n} bytes of data")
    return out


def _check_header(header: dict, layers: list[int], kinds: tuple[str, ...], weights: bool, T: int, bad) -> None:
    """The tensor file's names, dtypes and shapes (``{name: (dtype, shape)}`` from its header) against
    ``trace.json``'s layers and ``T`` tokens, before any tensor is read."""
    expected = {f"{i}.{k}" for i in layers for k in kinds}
    missing = [(i, k) for i in layers for k in kinds if f"{i}.{k}" not in header]
    if missing:
        raise bad(f"layer {missing[0][0]} has no {missing[0][1]!r} tensor")
    expected |= {f"{i}.sink" for i in layers if f"{i}.sink" in header}       # learned sink shares (optional)
    if set(header) - expected:
        raise bad(f"{TRACE_TENSORS} holds an unexpected tensor {sorted(set(header) - expected)[0]!r}")
    for i in layers:
        lt = {k: header[f"{i}.{k}"] for k in kinds + (("sink",) if f"{i}.sink" in header else ())}
        for k, (dtype, _) in lt.items():
            if dtype != "F32":
                raise bad(f"layer {i}: {k!r} is {_DTYPES.get(dtype, dtype)}, expected float32")
        a, v = lt["a"][1], lt["v"][1]
        if len(a) != 3 or a[1] != a[2]:
            raise bad(f"layer {i}: attention has shape {list(a)}, expected [heads, T, T]")
        if a[-1] != T:
            raise bad(f"layer {i}: attention covers {a[-1]} tokens but {TRACE_META} has {T}")
        H = a[0]
        if len(v) != 3 or tuple(v[:2]) != (H, T):
            raise bad(f"layer {i}: 'v' has shape {list(v)}, expected [{H}, {T}, head_dim]")
        d = v[2]
        shapes = ({"G": (H, d, d)} if weights else {"value_norm": (H, T), "uG": (H, T, d), "p": (H, T, d)})
        shapes.update({"sink": (H, T)} if "sink" in lt else {})
        for k, shape in shapes.items():
            if lt[k][1] != shape:
                raise bad(f"layer {i}: {k!r} has shape {list(lt[k][1])}, expected {list(shape)}")
        if weights and (len(lt["w_o"][1]) != 2 or lt["w_o"][1][1] != H * d):
            raise bad(f"layer {i}: 'w_o' has shape {list(lt['w_o'][1])}, expected [D, {H * d}]")


_DTYPES = {"F64": "float64", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
           "I8": "int8", "U8": "uint8", "BOOL": "bool"}


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
            "tokens_sha256": tokens_sha256(trace.ids, trace.tokens),
            "model_name": trace.model_name, "layers": [int(lt.index) for lt in trace.layers],
            "weights": bool(weights), "tensors_sha256": hashlib.sha256(data).hexdigest(),
            **({} if trace.prompt_length is None else {"prompt_length": int(trace.prompt_length)}),
            "special": [int(p) for p in trace.special], "template": [int(p) for p in trace.template]}
    atomic_write_bytes(path / TRACE_META, json.dumps(meta).encode("utf-8"))
    return path
