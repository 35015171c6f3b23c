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
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from . import metrics as M
from .capture import Block, Intervention, LayerState, Session, attngeom_attention_implementation
from .errors import InputError
from .reducers import Batch, FullCapture, Reducer

TextOrIds = "str | Sequence[int] | torch.Tensor"


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def to_ids(handle, item) -> list[int]:
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


def check_length(handle, n: int) -> None:
    """Inputs longer than the model's context are refused: use :func:`attngeom.data.windows`."""
    limit = getattr(handle, "max_positions", None)
    if limit and n > limit:
        raise InputError(
            f"input has {n} tokens but {getattr(handle, 'name', 'the model')} handles at most {limit}; "
            "cut it into windows (attngeom.data.windows, or --window/--stride on the command line)"
        )


def make_batches(handle, items: Iterable, batch_size: int = 1) -> Iterator[Batch]:
    """Group inputs into right-padded batches of at most ``batch_size`` texts."""
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
        chunk.append((i, ids))
        if len(chunk) == batch_size:
            yield flush()
            chunk = []
    if chunk:
        yield flush()


# --------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def forward(handle, batch: Batch, session: Session, logits: bool = False) -> torch.Tensor | None:
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


def token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Negative log-likelihood of each next token: ``logits [B, T, V]`` -> ``[B, T-1]`` (0 on padding).

    Position ``t`` holds ``-log p(x_{t+1} | x_{<=t})``; the first token is never predicted."""
    ids = batch.ids.to(logits.device)
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = torch.arange(ids.shape[1] - 1, device=ids.device)[None, :] < (batch.lengths.to(ids.device)[:, None] - 1)
    return nll * valid


def stream(
    handle,
    items: Iterable,
    reducers: Sequence[Reducer],
    *,
    layers: Iterable[int] | None = None,
    batch_size: int = 1,
    intervention: Intervention | None = None,
    progress: bool | str = True,
    total: int | None = None,
    block_elements: int | None = None,
) -> Sequence[Reducer]:
    """Run every input through the model with ``reducers`` observing ``layers`` (default: all).

    Keeps no full maps: each reducer keeps its own summaries. Returns the reducers."""
    from tqdm.auto import tqdm

    session = Session(observers=reducers, intervention=intervention, layers=layers,
                      block_elements=block_elements)
    desc = progress if isinstance(progress, str) else "analyse"
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    bar = tqdm(total=total, desc=desc, unit="text", disable=not progress)
    for batch in make_batches(handle, items, batch_size):
        for r in reducers:
            r.begin(batch)
        forward(handle, batch, session)
        for r in reducers:
            r.end(batch)
        bar.update(len(batch.index))
    bar.close()
    return reducers


# --------------------------------------------------------------------------------------------
# Full traces
# --------------------------------------------------------------------------------------------


@dataclass
class LayerTrace:
    """One attention layer of one text. Maps are numpy float32 ``[heads, T, T]`` (queries x
    sources), computed on first access from the stored head-space pieces (the same
    :class:`~attngeom.capture.Block` code the streaming path runs)."""

    index: int
    a: torch.Tensor        # [H, T, T]
    v: torch.Tensor        # [H, T, d]
    G: torch.Tensor        # [H, d, d]
    w_o: torch.Tensor      # [D, H*d]

    @property
    def num_heads(self) -> int:
        return self.a.shape[0]

    @cached_property
    def block(self) -> Block:
        """The whole layer as one block (batch of one)."""
        T = self.a.shape[-1]
        state = LayerState(layer=self.index, module=None, v=self.v[None], w_o=self.w_o, G=self.G,
                           G_full=M.full_gram(self.w_o), kv_head=torch.arange(self.num_heads),
                           lengths=torch.tensor([T]))
        return Block(state=state, a=self.a[None], q_start=0, k_start=0)

    def _np(self, x: torch.Tensor) -> np.ndarray:
        return x[0].numpy()

    @cached_property
    def attention(self) -> np.ndarray:
        return self.a.numpy()

    @cached_property
    def value_weighted(self) -> np.ndarray:
        return self._np(self.block.value_weighted)

    @cached_property
    def output_normalized(self) -> np.ndarray:
        return self._np(self.block.output_normalized)

    @cached_property
    def contribution(self) -> np.ndarray:
        return self._np(self.block.contribution)

    @cached_property
    def contribution_inter(self) -> np.ndarray:
        return self._np(self.block.contribution_inter)

    @cached_property
    def value_norm(self) -> np.ndarray:
        """``‖ṽ_j^h‖``: ``[heads, T]``."""
        return self._np(self.block.value_norm)

    @cached_property
    def head_output_norm(self) -> np.ndarray:
        """``‖o_i^h‖``: ``[heads, T]``."""
        return self._np(self.block.head_output_norm)

    @cached_property
    def output_norm(self) -> np.ndarray:
        """``‖o_i‖`` (layer attention output before the o_proj bias): ``[T]``."""
        return self._np(self.block.output_norm)

    @cached_property
    def head_share(self) -> np.ndarray:
        """``Σ_j C_ij^h``: ``[heads, T]``."""
        return self._np(self.block.head_share)

    def factors(self) -> dict[str, np.ndarray]:
        """The three factors of the intra-head contribution, each ``[heads, T, T]``."""
        return {k: self._np(x) for k, x in self.block.factors().items()}

    def metric(self, name: str) -> np.ndarray:
        if name not in M.METRICS:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(M.METRICS)}")
        return getattr(self, name)

    def token_score(self, name: str) -> np.ndarray:
        """Token-level score of SPEC §2 (all heads): ``[T, T]``."""
        per_head = self.contribution_inter if name == "contribution" else self.metric(name)
        return M.token_scores(name, torch.from_numpy(per_head)[None])[0].numpy()


@dataclass
class Trace:
    """Everything :func:`analyze` captured for one text."""

    ids: list[int]
    tokens: list[str]
    layers: list[LayerTrace]
    model_name: str = ""

    def __len__(self) -> int:
        return len(self.ids)

    def save(self, path: str | Path) -> Path:
        """Save to a directory (``trace.json`` + ``tensors.safetensors``); reopen with :meth:`load`."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for lt in self.layers:
            for k in ("a", "v", "G", "w_o"):
                tensors[f"{lt.index}.{k}"] = getattr(lt, k).contiguous()
        save_file(tensors, str(path / "tensors.safetensors"))
        meta = {"ids": self.ids, "tokens": self.tokens, "model_name": self.model_name,
                "layers": [lt.index for lt in self.layers], "format": "attngeom-trace-1"}
        (path / "trace.json").write_text(json.dumps(meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads((path / "trace.json").read_text())
        t = load_file(str(path / "tensors.safetensors"))
        layers = [LayerTrace(i, t[f"{i}.a"], t[f"{i}.v"], t[f"{i}.G"], t[f"{i}.w_o"]) for i in meta["layers"]]
        return cls(ids=meta["ids"], tokens=meta["tokens"], layers=layers, model_name=meta["model_name"])


def analyze_batch(handle, items: Sequence, *, layers: Iterable[int] | None = None, batch_size: int = 4,
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
                LayerTrace(layer, st["a"][b, :, :L, :L].clone(), st["v"][b, :, :L].clone(), st["G"], st["w_o"])
                for layer, st in sorted(capture.result().items())
            ]
            traces[i] = Trace(ids=ids, tokens=handle.tokens(ids), layers=lts, model_name=getattr(handle, "name", ""))
    return [traces[i] for i in sorted(traces)]


def analyze(handle, text, *, layers: Iterable[int] | None = None, block_elements: int | None = None) -> Trace:
    """Full trace of one text (a string, or token ids): every layer's metric maps.

    ``analyze(load_model("smollm2-135m"), "some text").layers[5].contribution`` is a
    ``[heads, T, T]`` float32 array. For long inputs or corpora use :func:`stream`."""
    if isinstance(text, (list, tuple)) and text and isinstance(text[0], str):
        raise InputError("analyze takes one text; use analyze_batch for several")
    return analyze_batch(handle, [text], layers=layers, batch_size=1, block_elements=block_elements)[0]
