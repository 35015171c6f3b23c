"""Running a model under the capture plug-in: full traces for one text, streams for corpora.

- :func:`analyze` — one text (or token ids) -> :class:`Trace` with every layer's metric maps.
- :func:`analyze_batch` — several texts, right-padded into batches; per-text results equal
  one-at-a-time results.
- :func:`stream` — any number of texts through a list of reducers (per-head, per-token summaries,
  and the later analyses), keeping no full maps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import metrics
from . import registry
from .capture import Block, Intervention, LayerState, Session, attngeom_attention_implementation
from .errors import InputError, OutputError, TraceFormatError
from .experiment import ModelHandleLike, RunLike
from .reducers import Batch, FullCapture, Reducer


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def to_ids(handle: ModelHandleLike, item) -> list[int]:
    """A text (BOS prepended where the tokenizer has one) or token ids -> list of ids."""
    if isinstance(item, str):
        return list(handle.encode(item))
    if isinstance(item, torch.Tensor):
        item = item.reshape(-1).tolist()
    ids = [int(x) for x in item]
    if not ids:
        raise InputError("empty input: no tokens to analyse")
    vocab = handle.model.config.vocab_size
    bad = [x for x in ids if not 0 <= x < vocab]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    return ids


def check_length(handle: ModelHandleLike, n: int) -> None:
    """Inputs longer than the model's context are refused: use :func:`attngeom.data.windows`."""
    limit = getattr(handle, "max_positions", None)
    if limit and n > limit:
        raise InputError(
            f"input has {n} tokens but {getattr(handle, 'name', 'the model')} handles at most {limit}; "
            "cut it into windows (attngeom.data.windows, or --window/--stride on the command line)"
        )


def make_batches(handle: ModelHandleLike, items: Iterable, batch_size: int = 1,
                 index: Sequence[int] | None = None) -> Iterator[Batch]:
    """Group inputs into right-padded batches of at most ``batch_size`` texts. ``index``: each
    input's number in the whole stream (default ``0, 1, ...``): reducers see it as ``batch.index``."""
    pad = handle.tokenizer.pad_token_id if handle.tokenizer.pad_token_id is not None else 0
    chunk: list[tuple[int, list[int]]] = []

    def flush():
        T = max(len(ids) for _, ids in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        for b, (_, x) in enumerate(chunk):
            ids[b, : len(x)] = torch.tensor(x)
        return Batch(ids=ids, lengths=torch.tensor([len(x) for _, x in chunk]), index=[i for i, _ in chunk])

    for i, item in enumerate(items):
        ids = to_ids(handle, item)
        check_length(handle, len(ids))
        chunk.append((i if index is None else int(index[i]), ids))
        if len(chunk) == batch_size:
            yield flush()
            chunk = []
    if chunk:
        yield flush()


# --------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def forward(handle: ModelHandleLike, batch: Batch, session: Session, logits: bool = False) -> torch.Tensor | None:
    """One forward pass of ``batch`` with ``session`` active. Returns float32 logits ``[B, T, V]``
    when ``logits`` is set (else only the last position's are computed, and None is returned)."""
    model = handle.model
    device = model.device
    with attngeom_attention_implementation(model), session.active(batch.lengths.to(device)):
        out = model(
            input_ids=batch.ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            use_cache=False,
            logits_to_keep=0 if logits else 1,
        )
    return out.logits.float() if logits else None


NLL_CHUNK_ELEMENTS = 1 << 20
"""Logits per log-softmax call in :func:`token_nll` (4 MiB of float32)."""


def token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Negative log-likelihood of each next token: ``logits [B, T, V]`` -> ``[B, T-1]`` (0 on padding).

    Position ``t`` holds ``-log p(x_{t+1} | x_{<=t})``; the first token is never predicted."""
    ids = batch.ids.to(logits.device)
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)
    target = torch.roll(ids, -1, dims=1).reshape(B * T, 1)           # the last position's is never kept
    out = torch.empty(B * T, dtype=torch.float32, device=logits.device)
    rows = max(1, NLL_CHUNK_ELEMENTS // max(1, V))
    for r0 in range(0, B * T, rows):
        # a few positions at a time: the log-softmax of a chunk stays in cache instead of a
        # [B, T, V] copy of the logits (identical values: each position is normalised on its own)
        lp = torch.log_softmax(flat[r0:r0 + rows].float(), dim=-1)
        out[r0:r0 + rows] = -lp.gather(-1, target[r0:r0 + rows]).squeeze(-1)
    nll = out.view(B, T)[:, :-1]
    valid = torch.arange(ids.shape[1] - 1, device=ids.device)[None, :] < (batch.lengths.to(ids.device)[:, None] - 1)
    return nll * valid


@torch.no_grad()
def batch_nll(handle: ModelHandleLike, batch: Batch, session: Session | None = None,
              last: int | None = None) -> torch.Tensor:
    """Summed next-token NLL of each text of ``batch`` under ``session`` (default: unedited):
    float64 ``[B]``. ``last``: score only the last ``last`` predictions of each row (e.g. the
    continuation of a multiple-choice option); default every prediction (``lengths - 1``).
    The one NLL loop every perplexity in attngeom goes through."""
    logits = forward(handle, batch, session or Session(), logits=True)
    nll = token_nll(logits, batch)
    del logits
    if last is not None:
        T = nll.shape[1]
        keep = torch.arange(T, device=nll.device)[None, :] >= (batch.lengths.to(nll.device)[:, None] - 1 - last)
        nll = nll * keep
    return nll.double().sum(-1).cpu()


def scored_tokens(batch: Batch) -> int:
    """Next-token predictions in ``batch``: ``Σ (length - 1)``."""
    return int((batch.lengths - 1).clamp_min(0).sum())


def stream(
    handle: ModelHandleLike,
    items: Iterable,
    reducers: Sequence[Reducer],
    *,
    layers: Iterable[int] | None = None,
    batch_size: int = 1,
    intervention: Intervention | None = None,
    progress: bool | str = True,
    total: int | None = None,
    block_elements: int | None = None,
    index: Sequence[int] | None = None,
) -> Sequence[Reducer]:
    """Run every input through the model with ``reducers`` observing ``layers`` (default: all).

    Keeps no full maps: each reducer keeps its own summaries. ``index``: the inputs' numbers in the
    whole stream (see :func:`make_batches`). Returns the reducers."""
    from tqdm.auto import tqdm

    session = Session(observers=reducers, intervention=intervention, layers=layers,
                      block_elements=block_elements)
    desc = progress if isinstance(progress, str) else "analyse"
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    bar = tqdm(total=total, desc=desc, unit="text", disable=not progress)
    for batch in make_batches(handle, items, batch_size, index=index):
        for r in reducers:
            r.begin(batch)
        forward(handle, batch, session)
        for r in reducers:
            r.end(batch)
        bar.update(len(batch.index))
    bar.close()
    return reducers


def reduce_stage(handle: ModelHandleLike, run: RunLike, name: str, items: Sequence,
                 make: Callable[[], Sequence[Reducer]], *, layers: Iterable[int] | None = None, batch_size: int = 1,
                 desc: str | None = None) -> list[Reducer]:
    """Stream ``items`` through fresh reducers ``make()`` as stage ``name`` of ``run`` (an
    :class:`attngeom.runner.Run`: one record of reducer states per group of items, resumable and
    shareable among processes; None: in memory), then return ``make()`` loaded with the merged
    states of every record: the reducers as if one pass had seen every item. Each item keeps its
    index in ``items`` as ``batch.index``."""
    from .runner import Memory, fingerprint, merge_sums

    ids = [to_ids(handle, x) for x in items]

    def work(units: list[int]) -> dict:
        reducers = make()
        stream(handle, [ids[u] for u in units], reducers, layers=layers, batch_size=batch_size, progress=False,
               index=units)
        return {str(k): r.state() for k, r in enumerate(reducers)}

    records = (run or Memory()).stage(name, len(ids), work, group=batch_size, desc=desc or name, unit="window",
                                      fingerprints=[fingerprint(x) for x in ids])
    merged = merge_sums(records.values())
    return [r.load_state(merged[str(k)]) for k, r in enumerate(make())]


def summaries(handle: ModelHandleLike, run: RunLike, items: Sequence, *, layers: Iterable[int] | None = None,
              sink: int = 0, batch_size: int = 1, stage: str = "summaries"):
    """Per-head (:class:`~attngeom.reducers.HeadStats`) and per-token
    (:class:`~attngeom.reducers.TokenStats`) summaries of ``items`` as one stage of ``run``
    (:func:`reduce_stage`). Returns ``(heads, tokens)`` DataFrames; ``tokens.text`` is the item's index."""
    from .reducers import HeadStats, TokenStats

    hs, ts = reduce_stage(handle, run, stage, items, lambda: [HeadStats(sink=sink), TokenStats(sink=sink)],
                          layers=layers, batch_size=batch_size, desc="analyse")
    return hs.result(), ts.result()


# --------------------------------------------------------------------------------------------
# Full traces
# --------------------------------------------------------------------------------------------


@dataclass
class LayerTrace:
    """One attention layer of one text. Maps are numpy float32 ``[heads, T, T]`` (queries x
    sources), one per metric of :mod:`attngeom.registry` (``layer.contribution``,
    ``layer.metric(name)``), computed on first access from the stored head-space pieces (the same
    :class:`~attngeom.capture.Block` code the streaming path runs)."""

    index: int
    a: torch.Tensor        # [H, T, T]
    v: torch.Tensor        # [H, T, d]
    G: torch.Tensor        # [H, d, d]
    w_o: torch.Tensor      # [D, H*d]
    learned_sink: torch.Tensor | None = None  # [H, T] a_i∅: the learned sink's share (gpt-oss; SPEC §1)

    @property
    def num_heads(self) -> int:
        return self.a.shape[0]

    @cached_property
    def block(self) -> Block:
        """The whole layer as one block (batch of one)."""
        T = self.a.shape[-1]
        state = LayerState(layer=self.index, module=None, v=self.v[None], w_o=self.w_o, G=self.G,
                           G_full=metrics.full_gram(self.w_o), kv_head=torch.arange(self.num_heads),
                           lengths=torch.tensor([T]))
        return Block(state=state, a=self.a[None], q_start=0, k_start=0, learned_sink=self._sink())

    def _sink(self) -> torch.Tensor | None:
        return None if self.learned_sink is None else self.learned_sink[None]

    def _np(self, x: torch.Tensor) -> np.ndarray:
        return x[0].numpy()

    QUANTITIES = ("value_norm", "head_output_norm", "output_norm", "head_share", "entropy")
    """Per-token quantities offered as numpy arrays: ``value_norm`` ``‖ṽ_j^h‖ [heads, T]``,
    ``head_output_norm`` ``‖o_i^h‖ [heads, T]``, ``output_norm`` ``‖o_i‖ [T]`` (layer attention
    output before the o_proj bias), ``head_share`` ``Σ_j C_ij^h [heads, T]``, ``entropy`` (nats)
    ``[heads, T]``."""

    def __getattr__(self, name: str):
        """``layer.<metric>`` for every metric of :mod:`attngeom.registry` (numpy float32
        ``[heads, T, T]``, queries x sources) and ``layer.<quantity>`` for :attr:`QUANTITIES`;
        computed on first access by the layer's :class:`~attngeom.capture.Block` and kept."""
        if name.startswith("_") or (name not in registry.METRICS and name not in LayerTrace.QUANTITIES):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        block = self.block
        x = self._np(block.metric(name) if name in registry.METRICS else getattr(block, name))
        self.__dict__[name] = x
        return x

    def factors(self) -> dict[str, np.ndarray]:
        """The three factors of the intra-head contribution, each ``[heads, T, T]``."""
        return {k: self._np(x) for k, x in self.block.factors().items()}

    def metric(self, name: str) -> np.ndarray:
        """A per-head map of :mod:`attngeom.registry` by name: ``[heads, T, T]``."""
        if name not in registry.METRICS:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(registry.METRICS)}")
        return getattr(self, name)

    def token_score(self, name: str) -> np.ndarray:
        """Token-level score of SPEC §2 (all heads), as the registry defines it: ``[T, T]``."""
        m = registry.METRICS.get(name)
        if m is None:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(registry.METRICS)}")
        per_head = self.metric(m.token_map or name)
        return metrics.token_scores(torch.from_numpy(per_head)[None], m.heads)[0].numpy()


@dataclass
class Trace:
    """Everything :func:`analyze` captured for one text. ``prompt_length``: for a generation
    (:func:`attngeom.generate.analyze`), the number of prompt tokens (the answer follows); None
    for a text analysed as given."""

    ids: list[int]
    tokens: list[str]
    layers: list[LayerTrace]
    model_name: str = ""
    prompt_length: int | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def generated(self) -> np.ndarray:
        """``[T]`` bool: True for the tokens the model generated (all False for a given text)."""
        out = np.zeros(len(self.ids), dtype=bool)
        if self.prompt_length is not None:
            out[self.prompt_length:] = True
        return out

    def to_html(self, path: str | Path, **options) -> Path:
        """Write the interactive explorer of this trace (one offline HTML file, see docs/explore.md);
        ``options`` go to :func:`attngeom.explore.from_trace` (``top_k``, ``exact_max_tokens``, ``sink``)."""
        from .explore import from_trace
        from .reports.explore import write

        return write(from_trace(self, **options), path)

    def _repr_html_(self) -> str:
        """The explorer inline in Jupyter (an ``<iframe srcdoc>``)."""
        from .explore import from_trace
        from .reports.explore import iframe

        return iframe(from_trace(self))

    def save(self, path: str | Path, *, weights: bool = False) -> Path:
        """Save to a directory (``trace.json`` + ``tensors.safetensors``); reopen with :meth:`load`.

        By default no model weights are stored: per layer the attention ``a [H,T,T]``, the values
        ``v [H,T,d]`` and the three per-token head-space quantities every metric is computed from
        (``‖ṽ_j^h‖ [H,T]``, ``u_i^h G^h [H,T,d]`` and ``p_i^h = o_i W_O^{hᵀ} [H,T,d]``). Every map,
        norm, share and factor of the reloaded trace equals the original; a 10-token trace of
        SmolLM2-135M is 2.2 MB (45 MB with weights). ``weights=True`` stores ``G [H,d,d]`` and
        ``w_o [D,H*d]`` instead (``LayerTrace.G``/``.w_o``, None in a weight-less trace), for work
        that needs the output projection itself (e.g. the model-space output ``o_i``).
        ``trace.json`` is written last and records the tensor file's SHA-256."""
        import hashlib

        from safetensors.torch import save as save_bytes

        from .io import atomic_write_bytes

        path = Path(path)
        if weights and any(lt.w_o is None or lt.G is None for lt in self.layers):
            raise InputError("this trace was saved without weights; it cannot be saved with weights=True")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the trace directory {path}: {e.strerror or e}") from None
        tensors = {}
        for lt in self.layers:
            for k, x in _layer_tensors(lt, weights).items():
                tensors[f"{lt.index}.{k}"] = x.detach().to("cpu", torch.float32).contiguous()
        data = save_bytes(tensors)
        atomic_write_bytes(path / TRACE_TENSORS, data)
        meta = {"format": TRACE_FORMAT, "ids": [int(i) for i in self.ids], "tokens": list(self.tokens),
                "model_name": self.model_name, "layers": [int(lt.index) for lt in self.layers],
                "weights": bool(weights), "tensors_sha256": hashlib.sha256(data).hexdigest(),
                **({} if self.prompt_length is None else {"prompt_length": int(self.prompt_length)})}
        atomic_write_bytes(path / TRACE_META, json.dumps(meta).encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Reopen a trace written by :meth:`save`. Everything is checked before use: the format
        version, the token list against the ids and the tensors, every tensor's name, shape, dtype
        and finiteness, the attention rows (non-negative, nothing above the diagonal, each summing
        to one) and the tensor file's checksum. Anything wrong raises :class:`TraceFormatError`
        with a one-line message."""
        return _load_trace(cls, Path(path))


# --------------------------------------------------------------------------------------------
# Saved traces (Trace.save / Trace.load)
# --------------------------------------------------------------------------------------------

TRACE_FORMAT = "attngeom-trace-2"
"""Version 2: weight-less by default, checksum in ``trace.json``. Version 1 (always with weights,
no checksum) is still read."""
TRACE_META, TRACE_TENSORS = "trace.json", "tensors.safetensors"
_PIECES = ("a", "v", "value_norm", "uG", "p")      # weight-less
_WEIGHTED = ("a", "v", "G", "w_o")                 # weights=True, and format 1
_ROW_TOL = 1e-2                                    # attention row sums (bf16 models stay well inside)


def _layer_tensors(lt: LayerTrace, weights: bool) -> dict[str, torch.Tensor]:
    sink = {} if lt.learned_sink is None else {"sink": lt.learned_sink}
    if weights:
        return {"a": lt.a, "v": lt.v, "G": lt.G, "w_o": lt.w_o, **sink}
    blk = lt.block
    return {"a": lt.a, "v": lt.v, "value_norm": blk.value_norm[0], "uG": blk.uG[0], "p": blk.pulled_back[0], **sink}


def _frozen_layer(index: int, t: dict[str, torch.Tensor]) -> LayerTrace:
    """A :class:`LayerTrace` of a weight-less trace: its block is seeded with the saved per-token
    quantities, so every metric is computed by the same :class:`Block` code as before saving."""
    a, v = t["a"], t["v"]
    H, T = a.shape[0], a.shape[-1]
    lt = LayerTrace(index=index, a=a, v=v, G=None, w_o=None, learned_sink=t.get("sink"))
    state = LayerState(layer=index, module=None, v=v[None], w_o=None, G=None, G_full=None,
                       kv_head=torch.arange(H), lengths=torch.tensor([T]))
    state.__dict__["value_norm"] = t["value_norm"][None]        # LayerState.value_norm is cached
    block = Block(state=state, a=a[None], q_start=0, k_start=0, learned_sink=lt._sink())
    block._cache.update(uG=t["uG"][None], p=t["p"][None])
    lt.__dict__["block"] = block                                  # LayerTrace.block is cached
    return lt


def _load_trace(cls, path: Path) -> "Trace":
    import hashlib

    def bad(msg: str) -> TraceFormatError:
        return TraceFormatError(f"{path}: {msg}")

    if not path.is_dir():
        raise bad("not a saved trace (no such directory)" if not path.exists() else "not a directory")
    meta_file, tensor_file = path / TRACE_META, path / TRACE_TENSORS
    for f in (meta_file, tensor_file):
        if not f.is_file():
            raise bad(f"{f.name} is missing; a saved trace holds {TRACE_META} and {TRACE_TENSORS}")
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
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
        out.append(LayerTrace(index=i, a=a, v=v, G=lt["G"], w_o=lt["w_o"], learned_sink=lt.get("sink")) if weights
                   else _frozen_layer(i, lt))
    if checksum is not None and hashlib.sha256(data).hexdigest() != checksum:
        raise bad(f"{TRACE_TENSORS} does not match the checksum in {TRACE_META} (changed or damaged)")
    return cls(ids=ids, tokens=tokens, layers=out, model_name=name, prompt_length=prompt_length)


def analyze_batch(handle: ModelHandleLike, items: Sequence, *, layers: Iterable[int] | None = None, batch_size: int = 4,
                  block_elements: int | None = None) -> list[Trace]:
    """Full traces of several texts (or id lists), right-padded into batches of ``batch_size``.

    ``block_elements`` bounds ``B*H*Q*S`` per block of queries (smaller: less memory, more blocks)."""
    capture = FullCapture()
    traces: dict[int, Trace] = {}
    session = Session(observers=[capture], layers=layers,
                      block_elements=block_elements)
    for batch in make_batches(handle, items, batch_size):
        capture.begin(batch)
        forward(handle, batch, session)
        for b, i in enumerate(batch.index):
            L = int(batch.lengths[b])
            ids = batch.ids[b, :L].tolist()
            lts = [
                LayerTrace(layer, st["a"][b, :, :L, :L].clone(), st["v"][b, :, :L].clone(), st["G"], st["w_o"],
                           learned_sink=st["sink"][b, :, :L].clone() if "sink" in st else None)
                for layer, st in sorted(capture.result().items())
            ]
            traces[i] = Trace(ids=ids, tokens=handle.tokens(ids), layers=lts, model_name=getattr(handle, "name", ""))
    return [traces[i] for i in sorted(traces)]


def analyze(handle: ModelHandleLike, text, *, layers: Iterable[int] | None = None, block_elements: int | None = None,
            generate: int | None = None, **generation) -> Trace:
    """Full trace of one text (a string, or token ids): every layer's metric maps.

    ``analyze(load_model("smollm2-135m"), "some text").layers[5].contribution`` is a
    ``[heads, T, T]`` float32 array. For long inputs or corpora use :func:`stream`.

    ``generate=N``: ``text`` is a prompt (or a list of chat messages) and the trace covers prompt +
    the model's answer of up to ``N`` tokens, captured step by step with the KV cache;
    ``generation`` takes ``chat``, ``system``, ``sample``, ``temperature``, ``top_p``, ``seed`` and
    ``stop`` (:func:`attngeom.generate.analyze`, docs/generation.md)."""
    if generate is not None or generation:
        from . import generate as gen

        if generate is None:
            raise InputError(f"{sorted(generation)[0]} is an option of generation; give generate=N")
        return gen.analyze(handle, text, generate=generate, layers=layers, block_elements=block_elements,
                           **generation)
    if isinstance(text, (list, tuple)) and text and isinstance(text[0], str):
        raise InputError("analyze takes one text; use analyze_batch for several")
    return analyze_batch(handle, [text], layers=layers, batch_size=1, block_elements=block_elements)[0]
