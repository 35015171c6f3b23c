"""Inputs and forward passes under the capture plug-in: token ids from texts, right-padded batches,
one captured forward pass, the next-token NLL (the one NLL helper) and :func:`stream`, any number of
texts through a list of reducers keeping no full maps (SPEC §1-2).

What belongs here: what every experiment and the explorer run a model with. Not here: full traces
(:class:`~attngeom.traces.trace.Trace`, :func:`attngeom.traces.trace.analyze`), runner stages of reducers
(:mod:`attngeom.streaming.stages`), saved traces (:mod:`attngeom.traces.saved`).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from attngeom.model.arguments import takes_handle, whole_number
from attngeom.capture.blocks import Intervention
from attngeom.capture.session import attngeom_attention_implementation, Session
from attngeom.errors import InputError
from attngeom.runs.contract import ModelHandleLike
from attngeom.streaming.reducers import InputBatch, Reducer



# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@takes_handle
def to_ids(handle: ModelHandleLike, item) -> list[int]:
    """A text (BOS prepended where the tokenizer has one) or token ids -> list of ids, each checked
    against the model's embedding (:func:`check_ids`)."""
    if isinstance(item, str):
        return check_ids(handle, handle.encode(item))
    if isinstance(item, torch.Tensor):
        item = item.reshape(-1).tolist()
    try:
        ids = list(item)
    except TypeError:
        raise InputError(f"an input is a text or a sequence of token ids, not {type(item).__name__}") from None
    if not ids:
        raise InputError("empty input: no tokens to analyse")
    return check_ids(handle, ids)


def vocabulary_size(handle: ModelHandleLike) -> int:
    """The token ids the model can read: its input embedding's rows (a tokenizer may know more
    tokens than the model, and a config's ``vocab_size`` may not be the embedding's)."""
    try:
        return int(handle.model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        return int(handle.model.config.vocab_size)


def check_ids(handle: ModelHandleLike, ids: Sequence[int]) -> list[int]:
    """``ids`` as a list of ints, or an :class:`InputError` naming the first id that is not a whole
    number (:func:`~attngeom.model.arguments.whole_number`: ``True`` or ``2.7`` is no token id) or
    that the model has no embedding for (the embedding would raise a bare IndexError)."""
    ids = [whole_number(x, "a token id") for x in ids]
    vocab = vocabulary_size(handle)
    bad = [x for x in ids if not 0 <= x < vocab]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    return ids


@takes_handle
def check_length(handle: ModelHandleLike, n: int) -> None:
    """Inputs longer than the model's context are refused: use :func:`attngeom.data.corpora.windows`."""
    limit = getattr(handle, "max_positions", None)
    if limit and n > limit:
        raise InputError(
            f"input has {n} tokens but {getattr(handle, 'name', 'the model')} handles at most {limit}; "
            "cut it into windows (attngeom.data.corpora.windows, or --window/--stride on the command line)"
        )


@takes_handle
def make_batches(handle: ModelHandleLike, items: Iterable, batch_size: int = 1,
                 index: Sequence[int] | None = None) -> Iterator[InputBatch]:
    """Group inputs into right-padded batches of at most ``batch_size`` texts. ``index``: each
    input's number in the whole stream (default ``0, 1, ...``): reducers see it as ``batch.index``."""
    pad = handle.tokenizer.pad_token_id if handle.tokenizer.pad_token_id is not None else 0
    chunk: list[tuple[int, list[int]]] = []

    def flush():
        T = max(len(ids) for _, ids in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        for b, (_, x) in enumerate(chunk):
            ids[b, : len(x)] = torch.tensor(x)
        return InputBatch(ids=ids, lengths=torch.tensor([len(x) for _, x in chunk]), index=[i for i, _ in chunk])

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


@takes_handle
@torch.no_grad()
def forward(handle: ModelHandleLike, batch: InputBatch, session: Session, logits: bool = False) -> torch.Tensor | None:
    """One forward pass of ``batch`` with ``session`` active. Returns float32 logits ``[B, T, V]``
    when ``logits`` is set (else only the last position's are computed, and None is returned)."""
    model = handle.model
    device = model.device
    session.check(handle.num_layers)
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


def token_nll(logits: torch.Tensor, batch: InputBatch) -> torch.Tensor:
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


@takes_handle
@torch.no_grad()
def batch_nll(handle: ModelHandleLike, batch: InputBatch, session: Session | None = None,
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


def scored_tokens(batch: InputBatch) -> int:
    """Next-token predictions in ``batch``: ``Σ (length - 1)``."""
    return int((batch.lengths - 1).clamp_min(0).sum())


@takes_handle
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
    prepared: dict | None = None,
    route: str = "auto",
) -> Sequence[Reducer]:
    """Run every input through the model with ``reducers`` observing ``layers`` (default: all).

    Keeps no full maps: each reducer keeps its own summaries. ``index``: the inputs' numbers in the
    whole stream (see :func:`make_batches`). ``prepared``: the maps computed before the forward
    (``Session(prepared=...)``; one text's, so one input). ``route``: the capture's route
    (``Session(route=...)``, SPEC §10). Returns the reducers."""
    from tqdm.auto import tqdm

    session = Session(observers=reducers, intervention=intervention, layers=layers,
                      block_elements=block_elements, prepared=prepared, route=route)
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
