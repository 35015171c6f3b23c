"""Running a model under the capture plug-in: full traces for one text, streams for corpora (SPEC §2).

- :func:`analyze` — one text (or token ids) -> :class:`Trace` with every layer's metric maps.
- :func:`analyze_batch` — several texts, right-padded into batches; per-text results equal
  one-at-a-time results.
- :func:`stream` (:mod:`attngeom.streaming.passes`, re-exported here) — any number of texts through a list of
  reducers (per-head, per-token summaries, and the later analyses), keeping no full maps.

What belongs here: full traces (:class:`Trace`, :class:`LayerTrace`) and their building. Not here:
inputs, forward passes and streaming (:mod:`attngeom.streaming.passes`), runner stages (:mod:`attngeom.streaming.stages`),
saved traces' format (:mod:`attngeom.traces.saved`), the explorer (:mod:`attngeom.explorer.data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

from attngeom.model.arguments import check_count, check_position, takes_handle
from attngeom.model.handle import special_positions
from attngeom.metrics import formulas as metrics
from attngeom.metrics import registry
from attngeom.capture.blocks import Block, LayerState
from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.runs.contract import ModelHandleLike
from attngeom.streaming.passes import forward, make_batches
from attngeom.streaming.reducers import FullCapture

__all__ = ["LayerTrace", "Layers", "Trace", "analyze", "analyze_batch", "analyze_generation"]


# --------------------------------------------------------------------------------------------
# Full traces
# --------------------------------------------------------------------------------------------


@dataclass(repr=False)
class LayerTrace:
    """One attention layer of one text. Maps are numpy float32 ``[heads, T, T]`` (queries x
    sources), one per metric of :mod:`attngeom.metrics.registry` (``layer.contribution``,
    ``layer.metric(name)``), computed on first access from the stored head-space pieces (the same
    :class:`~attngeom.capture.blocks.Block` code the streaming path runs)."""

    index: int
    a: torch.Tensor        # [H, T, T]
    v: torch.Tensor        # [H, T, d]
    G: torch.Tensor        # [H, d, d]
    w_o: torch.Tensor      # [D, H*d]
    learned_sink: torch.Tensor | None = None  # [H, T] a_i∅: the learned sink's share (gpt-oss; SPEC §1)
    prepared: dict | None = None  # {metric: map} of the measures computed before the forward (analyze(prepare=...))

    @property
    def num_heads(self) -> int:
        return self.a.shape[0]

    def __repr__(self) -> str:
        return f"LayerTrace(layer {self.index}: {self.num_heads} heads, {self.a.shape[-1]} tokens)"

    @cached_property
    def block(self) -> Block:
        """The whole layer as one block (batch of one)."""
        T = self.a.shape[-1]
        state = LayerState(layer=self.index, module=None, value=self.v[None], w_o=self.w_o, G=self.G,
                           G_full=metrics.full_gram(self.w_o), kv_head=torch.arange(self.num_heads),
                           lengths=torch.tensor([T]), prepared=self.prepared)
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
        """``layer.<metric>`` for every metric of :mod:`attngeom.metrics.registry` (numpy float32
        ``[heads, T, T]``, queries x sources) and ``layer.<quantity>`` for :attr:`QUANTITIES`;
        computed on first access by the layer's :class:`~attngeom.capture.blocks.Block` and kept."""
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
        """A per-head map of :mod:`attngeom.metrics.registry` by name: ``[heads, T, T]``."""
        if name not in registry.METRICS:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(registry.METRICS)}")
        return getattr(self, name)

    def token_score(self, name: str) -> np.ndarray:
        """Token-level score of SPEC §2 (all heads), as the registry defines it: ``[T, T]``."""
        m = registry.METRICS.get(name)
        if m is None:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(registry.METRICS)}")
        if m.token is not None:
            return self._np(self.block.token_score(name))
        per_head = self.metric(m.token_map or name)
        return metrics.token_scores(torch.from_numpy(per_head)[None], m.heads)[0].numpy()


class Layers:
    """The layers of a :class:`Trace`, **keyed by layer number**: ``trace.layers[23]`` is layer 23
    whichever layers were analysed (an absent one is a one-line :class:`~attngeom.errors.InputError`
    naming the analysed layers). Iterating gives the :class:`LayerTrace` objects in layer order
    (``for lt in trace.layers``); :attr:`numbers`, :meth:`items`, ``n in trace.layers`` (a layer
    number), ``len`` and :meth:`pop` (frees a layer's maps) as a mapping has them."""

    def __init__(self, layers: Iterable[LayerTrace] = ()):
        self._by = {}
        for lt in layers:
            if lt.index in self._by:
                raise InputError(f"layer {lt.index} is given twice")
            self._by[int(lt.index)] = lt
        self._by = dict(sorted(self._by.items()))

    @property
    def numbers(self) -> list[int]:
        """The analysed layers' numbers, in order."""
        return list(self._by)

    def keys(self) -> list[int]:
        return self.numbers

    def values(self) -> list[LayerTrace]:
        return list(self._by.values())

    def items(self) -> list[tuple[int, LayerTrace]]:
        return list(self._by.items())

    def __getitem__(self, layer) -> LayerTrace:
        if isinstance(layer, slice) or isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InputError(f"trace.layers takes a layer number (one of {self.numbers}), not {layer!r}"[:200])
        if int(layer) not in self._by:
            raise InputError(f"layer {int(layer)} is not in the trace; it holds layers {self.numbers}"[:300])
        return self._by[int(layer)]

    def get(self, layer, default=None):
        return self._by.get(int(layer), default)

    def pop(self, layer) -> LayerTrace:
        """Layer ``layer``, removed from the trace (its maps are freed once the caller lets go)."""
        self[layer]
        return self._by.pop(int(layer))

    def __contains__(self, layer) -> bool:
        return isinstance(layer, (int, np.integer)) and int(layer) in self._by

    def __iter__(self):
        return iter(list(self._by.values()))

    def __len__(self) -> int:
        return len(self._by)

    def __repr__(self) -> str:
        return f"Layers({self.numbers})"


@dataclass(repr=False)
class Trace:
    """Everything :func:`analyze` captured for one text. ``prompt_length``: for a generation
    (:func:`analyze_generation`), the number of prompt tokens (the answer follows); None
    for a text analysed as given. ``special``: the positions of the tokenizer's special tokens
    (BOS, EOS, chat-format markers); ``template``: the positions the chat template put there (not
    the user's text; :func:`attngeom.generation.prompts.template_positions`)."""

    ids: list[int]
    tokens: list[str]
    layers: Layers
    model_name: str = ""
    prompt_length: int | None = None
    special: tuple[int, ...] = ()
    template: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.layers, Layers):
            self.layers = Layers(self.layers)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        layers = [lt.index for lt in self.layers]
        shown = f"{layers[0]}..{layers[-1]}" if len(layers) > 3 else ",".join(map(str, layers))
        answer = "" if self.prompt_length is None else f", prompt {self.prompt_length} + answer {len(self) - self.prompt_length}"
        text = "".join(self.tokens[:12]).replace("\n", "⏎")
        return (f"Trace({self.model_name or 'model'}: {len(self)} tokens{answer}, {len(layers)} layer(s) [{shown}], "
                f"{next(iter(self.layers)).num_heads if self.layers else 0} heads; {text[:60]!r}{'…' if len(self) > 12 else ''})")

    def marks(self) -> "pd.DataFrame":
        """One row per position: ``source_id``, ``source_token``, ``part`` (``prompt``/``answer``, or
        ``text``), ``is_special``, ``is_template`` (:func:`attngeom.generation.heads.token_marks`)."""
        from attngeom.generation.heads import token_marks

        special = {self.ids[p] for p in self.special}
        return token_marks(self.ids, special, self.template, self.prompt_length, self.tokens)

    def heads_for(self, target, source: int | None = None, *, by: str = "contribution", top: int | None = 10,
                  exclude_special: bool = True, predicted: bool = True, layers: Iterable[int] | None = None):
        """Which (layer, head, source) triples carry ``target`` (:mod:`attngeom.generation.heads`): a
        pandas table of shares of each layer's attention output, largest first.

        ``target``: a position (negative counts from the end), a list of positions, or ``"answer"``
        (every generated token); several targets: the mean of their rows. ``predicted`` (default):
        the row that predicted the token (its producing row, ``target - 1``, SPEC §7); False: the
        token's own row. ``by``: ``"contribution"`` (``C_ij^h``, each layer's shares sum to 1) or
        ``"attention"`` (``a_ij^h / H``). ``source``: only that source (the link split by head and
        layer). ``top``: rows kept (None: all). ``exclude_special``: special and template tokens are
        left out of the ranking (they stay marked in :meth:`marks`). ``layers``: a subset of the
        analysed layers. A share is not a cause: :func:`attngeom.head_effects` ranks the heads by their
        direct effect and their effect under ablation on the next token, the share beside them."""
        from attngeom.generation.heads import BY, head_table, mean_shares, row_shares

        if by not in BY:
            raise InputError(f"by must be one of {', '.join(BY)}, not {by!r}"[:200])
        rows = self._target_rows(target, predicted)
        src = None if source is None else check_position(source, "source", len(self))
        top = None if top is None else check_count(top, "top")
        chosen = self._layers(layers)
        per_row = [{lt.index: row_shares(lt.block, r)[by] for lt in chosen} for r in rows]
        shares = per_row[0] if len(rows) == 1 else mean_shares(per_row, max(rows) + 1)
        return head_table(shares, self.marks().iloc[:max(rows) + 1], top=top, exclude_special=exclude_special,
                          source=src)

    def _target_rows(self, target, predicted: bool) -> list[int]:
        """The query rows that explain ``target`` (:meth:`heads_for`)."""
        T = len(self)
        if isinstance(target, str):
            if target != "answer":
                raise InputError(f"target must be a position, a list of positions or 'answer', not {target!r}")
            if self.prompt_length is None or self.prompt_length >= T:
                raise InputError("target 'answer' needs a generation's trace (analyze(..., generate=N))")
            targets = list(range(self.prompt_length, T))
        else:
            many = isinstance(target, (list, tuple, range, np.ndarray))
            targets = [check_position(t, "target", T) for t in (target if many else [target])]
            if not targets:
                raise InputError("no target position given")
        if predicted and 0 in targets:
            raise InputError("position 0 is predicted by no row; give predicted=False for its own row")
        return [t - 1 if predicted else t for t in targets]

    def _layers(self, layers) -> list["LayerTrace"]:
        from attngeom.data.corpora import check_layers

        if layers is None:
            return list(self.layers)
        return [self.layers[l] for l in sorted(set(check_layers(layers)))]

    @property
    def generated(self) -> np.ndarray:
        """``[T]`` bool: True for the tokens the model generated (all False for a given text)."""
        out = np.zeros(len(self.ids), dtype=bool)
        if self.prompt_length is not None:
            out[self.prompt_length:] = True
        return out

    def to_html(self, path: str | Path, **options) -> Path:
        """Write the interactive explorer of this trace (one offline HTML file, see docs/explore.md);
        ``options`` go to :func:`attngeom.explorer.data.from_trace` (``top_k``, ``exact_max_tokens``, ``sink``,
        ``measure``: a registry measure shown beside attention and contribution; one computed before the
        forward needs ``analyze(..., prepare=[measure])``)."""
        from attngeom.explorer.data import from_trace

        return from_trace(self, **options).to_html(path)

    def plot_token_map(self, layer: int, metric: str = "contribution", head: int | None = None, tokens=None,
                       path: str | Path | None = None, **options):
        """One map of ``layer`` for a paper (:func:`attngeom.reports.plot.token_map`): token level or
        ``head``, cropped to ``tokens`` (a slice of positions), saved to ``path`` in the format of its
        suffix (PDF, SVG, PNG, ...) or returned as a matplotlib figure; ``options``: ``width``, ``title``."""
        from attngeom.reports.plot import token_map

        return token_map(self, layer, metric, head=head, tokens=tokens, path=path, **options)

    def _repr_html_(self) -> str:
        """A short summary in Jupyter (the tokens, marked; no maps): the explorer is
        ``trace.to_html(path)``, or :meth:`explore` inline."""
        from attngeom.reports.explore import summary_html

        return summary_html(self)

    def explore(self, height: int = 760, **options):
        """The explorer inline in Jupyter (an ``<iframe srcdoc>`` holding the whole page; ``options`` as
        :meth:`to_html`): display the returned object."""
        from attngeom.explorer.data import from_trace
        from attngeom.reports.explore import Inline, iframe

        return Inline(iframe(from_trace(self, **options), height))

    def save(self, path: str | Path, *, weights: bool = False) -> Path:
        """Save to a directory (``trace.json`` + ``tensors.safetensors``); reopen with :meth:`load`.

        By default no model weights are stored: per layer the attention ``a [H,T,T]``, the values
        ``v [H,T,d]`` and the three per-token head-space quantities every metric is computed from
        (``‖ṽ_j^h‖ [H,T]``, ``u_i^h G^h [H,T,d]`` and ``p_i^h = o_i W_O^{hᵀ} [H,T,d]``). Every map,
        norm, share and factor of the reloaded trace equals the original; a 10-token trace of
        SmolLM2-135M is 2.2 MB (45 MB with weights). ``weights=True`` stores ``G [H,d,d]`` and
        ``w_o [D,H*d]`` instead (``LayerTrace.G``/``.w_o``, None in a weight-less trace), for work
        that needs the output projection itself (e.g. the model-space output ``o_i``).
        ``trace.json`` is written last and records the SHA-256 of its ids and tokens and of the tensor file."""
        from attngeom.traces.saved import save_trace

        return save_trace(self, Path(path), weights)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Reopen a trace written by :meth:`save`. Everything is checked before use, sizes before
        reading: the size of ``trace.json``, the format version, the token strings against the ids
        (their checksum in ``trace.json``) and the tensors, every tensor's name, dtype and shape from
        the tensor file's header (and the file's size against them and the machine's memory) before
        any tensor is read, then finiteness, the attention rows (non-negative, nothing above the
        diagonal, each summing to one) and the tensor file's checksum. Anything wrong raises
        :class:`~attngeom.errors.TraceFormatError` with a one-line message."""
        import os

        from attngeom.traces.saved import load_trace

        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"Trace.load takes the directory of a saved trace, not a value of type {type(path).__name__}")
        return load_trace(Path(path), cls, LayerTrace)


@takes_handle
def analyze_batch(handle: ModelHandleLike, items: Sequence, *, layers: Iterable[int] | None = None, batch_size: int = 4,
                  block_elements: int | None = None, prepare: Iterable[str] = ()) -> list[Trace]:
    """Full traces of several texts (or id lists), right-padded into batches of ``batch_size``.

    ``block_elements`` bounds ``B*H*Q*S`` per block of queries (smaller: less memory, more blocks).
    ``prepare``: measures computed before the forward (``grad_attention``, ``rollout``,
    ``contribution_rollout``: :func:`attngeom.metrics.registry.prepared_names`), each text's by its own
    pass (the gradient of its log-likelihood; the rollouts of its clean forward), so that
    ``layer.metric(name)`` / ``layer.token_score(name)`` read them (not stored by :meth:`Trace.save`)."""
    prepare = tuple(prepare)
    for name in prepare:
        if name not in registry.METRICS:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(registry.METRICS)}")
        if not registry.prepared_names([name]):
            raise InputError(f"{name} needs no pass before the forward; known: "
                             f"{', '.join(registry.prepared_names(registry.METRICS))}")
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
            maps = _prepared_maps(handle, ids, prepare)
            lts = [
                LayerTrace(layer, st["a"][b, :, :L, :L].clone(), st["v"][b, :, :L].clone(), st["G"], st["w_o"],
                           learned_sink=st["sink"][b, :, :L].clone() if "sink" in st else None,
                           prepared=maps.get(layer))
                for layer, st in sorted(capture.result().items())
            ]
            traces[i] = Trace(ids=ids, tokens=handle.tokens(ids), layers=lts, model_name=getattr(handle, "name", ""),
                              special=special_positions(handle, ids))
    return [traces[i] for i in sorted(traces)]


def _prepared_maps(handle: ModelHandleLike, ids: list[int], names: Sequence[str]) -> dict:
    if not names:
        return {}
    from attngeom.capture.prepared import prepare_text

    return prepare_text(handle, ids, names)


@takes_handle
def analyze_generation(handle: ModelHandleLike, prompt, *, generate: int, chat: bool = False,
                       system: str | None = None, sample: bool = False, temperature: float | None = None,
                       top_p: float | None = None, seed: int | None = None, stop: Sequence[int] | None = None,
                       layers: Iterable[int] | None = None, block_elements: int | None = None,
                       progress: bool = False) -> Trace:
    """Generate up to ``generate`` tokens after ``prompt`` (:mod:`attngeom.generation.decoding`) and return the
    :class:`Trace` of prompt + answer: ``trace.ids`` is exactly what the model saw, ``trace.prompt_length`` where
    the answer starts, and each layer's maps are the rows captured step by step (equal to a full
    forward of the same ids). Also reached as ``attngeom.analyze(model, prompt, generate=N, ...)``.
    ``progress``: a bar on stderr counting the generated tokens."""
    from attngeom.generation.decoding import Decoding, stream_generation_ids
    from attngeom.generation.prompts import prompt_ids, template_positions

    decoding = Decoding(generate, sample=sample, temperature=temperature, top_p=top_p, seed=seed,
                        stop=None if stop is None else tuple(stop))
    ids = prompt_ids(handle, prompt, chat=chat, system=system, stop=decoding.stop_ids(handle))
    capture = FullCapture(length=len(ids) + decoding.max_new_tokens)
    full = stream_generation_ids(handle, ids, [capture], decoding, layers=layers, block_elements=block_elements,
                      progress=progress)
    T = len(full)
    lts = [LayerTrace(layer, st["a"][0, :, :T, :T].clone(), st["v"][0, :, :T].clone(), st["G"], st["w_o"],
                      learned_sink=st["sink"][0, :, :T].clone() if "sink" in st else None)
           for layer, st in sorted(capture.result().items())]
    return Trace(ids=full, tokens=handle.tokens(full), layers=lts, model_name=getattr(handle, "name", ""),
                 prompt_length=len(ids), special=special_positions(handle, full),
                 template=template_positions(handle, prompt, chat=chat, system=system))


@takes_handle
def analyze(handle: ModelHandleLike, text, *, layers: Iterable[int] | None = None, block_elements: int | None = None,
            generate: int | None = None, prepare: Iterable[str] = (), **generation) -> Trace:
    """Full trace of one text (a string, or token ids): every layer's metric maps.

    ``analyze(load_model("smollm2-135m"), "some text").layers[5].contribution`` is layer 5's
    ``[heads, T, T]`` float32 array (``trace.layers`` is keyed by layer number: :class:`Layers`). For long inputs or corpora use :func:`stream`.

    ``generate=N``: ``text`` is a prompt (or a list of chat messages) and the trace covers prompt +
    the model's answer of up to ``N`` tokens, captured step by step with the KV cache;
    ``generation`` takes ``chat``, ``system``, ``sample``, ``temperature``, ``top_p``, ``seed`` and
    ``stop`` (:func:`analyze_generation`, docs/generation.md). ``prepare``: the measures computed
    before the forward to make available (:func:`analyze_batch`; a text analysed as given)."""
    if generate is not None or generation:
        if tuple(prepare):
            raise InputError("prepare= computes gradients and rollouts of a text analysed as given, not of a generation")
        if generate is None:
            raise InputError(f"{sorted(generation)[0]} is an option of generation; give generate=N")
        return analyze_generation(handle, text, generate=generate, layers=layers, block_elements=block_elements,
                           **generation)
    if isinstance(text, (list, tuple)) and text and isinstance(text[0], str):
        raise InputError("analyze takes one text; use analyze_batch for several")
    return analyze_batch(handle, [text], layers=layers, batch_size=1, block_elements=block_elements,
                         prepare=prepare)[0]
