"""Running a model under the capture plug-in: full traces for one text, streams for corpora.

- :func:`analyze` — one text (or token ids) -> :class:`Trace` with every layer's metric maps.
- :func:`analyze_batch` — several texts, right-padded into batches; per-text results equal
  one-at-a-time results.
- :func:`stream` — any number of texts through a list of reducers (per-head, per-token summaries,
  and the later analyses), keeping no full maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import metrics
from . import registry
from .capture import Block, Intervention, LayerState, Session, attngeom_attention_implementation
from .errors import InputError
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
        from .trace_io import save_trace

        return save_trace(self, Path(path), weights)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Reopen a trace written by :meth:`save`. Everything is checked before use: the format
        version, the token list against the ids and the tensors, every tensor's name, shape, dtype
        and finiteness, the attention rows (non-negative, nothing above the diagonal, each summing
        to one) and the tensor file's checksum. Anything wrong raises :class:`~attngeom.errors.TraceFormatError`
        with a one-line message."""
        from .trace_io import load_trace

        return load_trace(Path(path), cls, LayerTrace)


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
