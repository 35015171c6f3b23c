"""Generation with analysis: the model's own answer to a prompt, captured step by step with its KV cache
(SPEC §7; docs/generation.md).

- :func:`attngeom.generation.prompts.prompt_ids` — a text, token ids or a list of chat messages -> the
  ids the model reads (``chat=True``: through the tokenizer's chat template as a user message, ``system``
  optional).
- :class:`Decoding` — how tokens are chosen: greedy (default) or sampling with ``temperature``,
  ``top_p`` and a ``seed`` (reproducible); stop tokens.
- :func:`generate` — the decoding loop alone: every forward call runs through the capture plug-in
  with a :class:`~attngeom.capture.session.Session`, so its observers see the prompt's blocks and then one
  one-query block per layer and step (SPEC §1-2: the same ``a_ij^h``, ``v_j^h`` and metrics).
- :func:`stream_generation` — reducers over the generation, at every step, or as ``text_reducers`` over prompt +
  answer as a text (the answer in one call against the cached prompt); no ``T x T`` map kept.
- :func:`attngeom.traces.trace.analyze_generation` (``attngeom.analyze(model, prompt, generate=N)``) — a
  full :class:`~attngeom.traces.trace.Trace` of prompt + answer (``trace.prompt_length``,
  ``trace.generated``) whose maps are the per-step rows, built from :func:`stream_generation_ids` here.
- :func:`generation_stage` runs prompts through an :class:`attngeom.runs.run.Run` (resumable,
  data-parallel) with reducers such as :class:`attngeom.generation.answers.AnswerSources` (per generated
  token its top prompt sources and where its contribution comes from) observing.

**Exactness.** The cache (:class:`GrowingCache`, a ``DynamicCache`` preallocated to prompt + answer)
keeps every earlier token in every layer (a
sliding-window layer sees only its window through the model's own mask, as without a cache), so a
decoding step's block holds query ``t`` against sources ``0..t`` at their absolute positions, and
its metrics equal row ``t`` of a full forward of prompt + answer (tests/unit/test_generate.py).

**Which row explains a token.** Generated token ``x_t`` (position ``t >= P``, ``P`` the prompt
length) is predicted by the output at position ``t - 1``: its *producing row* is query ``t - 1``
(the last prompt token for the first answer token). Answer tables use producing rows. After the last
token is chosen, one more step runs it through the model so that the trace has every token's row
(``N + 1`` forward calls for ``N`` tokens; ``model.generate`` makes ``N``) when a step reducer reads
that row (``Reducer.READS_LAST_TOKEN``, True unless a reducer says otherwise: the answer tables read
producing rows only), or when there are no reducers at all; text reducers read the answer again.
"""


from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from attngeom.capture.blocks import Block
from attngeom.capture.kernel import GrowingTensor
from attngeom.capture.session import Session, attngeom_attention_implementation
from attngeom.errors import InputError
from attngeom.generation.prompts import prompt_ids
from attngeom.metrics import formulas as metrics
from attngeom.model.arguments import check_count, takes_handle
from attngeom.runs.contract import ModelHandleLike, RunLike
from attngeom.runs.run import fingerprint, merge_sums, run_or_in_memory
from attngeom.streaming.reducers import InputBatch, Reducer


@takes_handle
def model_stop_ids(handle: ModelHandleLike) -> tuple[int, ...]:
    """The model's end-of-generation ids: ``generation_config.eos_token_id`` and the tokenizer's EOS."""
    out: list[int] = []
    gc = getattr(handle.model, "generation_config", None)
    for x in (getattr(gc, "eos_token_id", None), handle.tokenizer.eos_token_id):
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            if i is not None and int(i) not in out:
                out.append(int(i))
    return tuple(out)


@dataclass(frozen=True)
class Decoding:
    """How the answer is chosen. ``max_new_tokens`` (at least 1); greedy (``argmax``, the first
    maximum) unless ``sample``: then ``softmax(logits / temperature)`` cut to the smallest set of
    most probable tokens whose probability reaches ``top_p`` (nucleus), drawn with a
    ``torch.Generator`` seeded by ``seed`` (default 0: a run is reproducible). ``stop``: ids that end
    the answer (kept as its last token); None: the model's (:func:`model_stop_ids`), ``()``: none.
    The model's other ``generation_config`` defaults (repetition penalties, ...) are not applied."""

    max_new_tokens: int
    sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[int, ...] | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        try:
            n = int(n.__index__()) if not isinstance(n, bool) else None   # ints, numpy ints; not 2.0 or True
        except (AttributeError, TypeError):
            n = None
        if n is None or n < 1:
            raise InputError(f"the number of tokens to generate must be a whole number, at least 1, got "
                             f"{self.max_new_tokens!r}")
        object.__setattr__(self, "max_new_tokens", n)
        if not self.sample:
            given = [k for k in ("temperature", "top_p", "seed") if getattr(self, k) is not None]
            if given:
                raise InputError(f"{given[0].replace('_', '-')} is for sampling; add --sample (sample=True)")
        if self.temperature is not None and not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise InputError(f"temperature must be a positive number, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:                                 # what torch.Generator.manual_seed takes
            object.__setattr__(self, "seed", check_count(self.seed, "the sampling seed", 0, 2 ** 64 - 1))

    def stop_ids(self, handle: ModelHandleLike) -> tuple[int, ...]:
        return model_stop_ids(handle) if self.stop is None else tuple(int(s) for s in self.stop)

    def generator(self, device) -> torch.Generator | None:
        if not self.sample:
            return None
        return torch.Generator(device=device).manual_seed(0 if self.seed is None else int(self.seed))

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The next token from float32 logits ``[V]``."""
        if not self.sample:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / (self.temperature or 1.0), dim=-1)
        if self.top_p is not None and self.top_p < 1:
            p, order = torch.sort(probs, descending=True, stable=True)
            keep = (p.cumsum(0) - p) < self.top_p             # the most probable token is always kept
            probs = torch.zeros_like(probs).scatter_(0, order[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=generator))


@takes_handle
def check_context(handle: ModelHandleLike, prompt_length: int, decoding: Decoding) -> None:
    """Refuse a prompt whose answer would run past the model's context."""
    limit = getattr(handle, "max_positions", None)
    total = prompt_length + decoding.max_new_tokens
    if limit and total > limit:
        raise InputError(f"the prompt has {prompt_length} tokens and {decoding.max_new_tokens} more would make "
                         f"{total}, past {getattr(handle, 'name', 'the model')}'s context of {limit} tokens")


class BatchMappedLayer(DynamicLayer):
    """A cache layer whose batch operations of ``generate`` (beam search, batch expansion) apply
    one function to every per-row tensor it holds (:meth:`_map_batch`)."""

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])


class GrowingLayer(BatchMappedLayer):
    """A full-attention cache layer whose keys and values are :class:`~attngeom.capture.kernel.GrowingTensor` s:
    room for ``capacity`` tokens from the first call (doubling past it), each call writes only its
    new tokens, and the keys and values handed to attention are views of the filled part — equal,
    element for element, to what transformers' ``DynamicLayer`` concatenates, without its copy of
    the whole cache at every step."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self._keys, self._values = GrowingTensor(2, capacity), GrowingTensor(2, capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._keys.append(key_states), self._values.append(value_states)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative count, as transformers' layers take it)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the number of tokens removed from the end")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(0, self._keys.length + tokens_to_remove)
        self._keys.truncate(keep)
        self._values.truncate(keep)
        self.keys, self.values = self._keys.tensor, self._values.tensor

    def reset(self) -> None:
        capacity = self._keys.capacity
        super().reset()
        self._keys, self._values = GrowingTensor(2, capacity), GrowingTensor(2, capacity)

    def _map_batch(self, fn) -> None:
        if self.get_seq_length() > 0:
            for g in (self._keys, self._values):
                g.map_storage(fn)
            self.keys, self.values = self._keys.tensor, self._values.tensor


class GrowingCache(DynamicCache):
    """The KV cache of a generation: a ``DynamicCache`` (every token in every layer, no config) of
    :class:`GrowingLayer` s with room for ``capacity`` tokens each (prompt + answer: no
    reallocation during the generation)."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = int(capacity)
        self.layer_class_to_replicate = lambda: GrowingLayer(self.capacity)


@takes_handle
@torch.no_grad()
def generate(handle: ModelHandleLike, ids: Sequence[int], decoding: Decoding, session: Session | None = None, *,
             steps: Session | None = None, last_step: bool = True, cache=None, progress: bool = False) -> list[int]:
    """Generate from prompt ``ids`` with the model's KV cache; every forward call runs through the
    capture plug-in. ``session`` (default: no observers) is active for the prompt's forward call
    and, unless ``steps`` is given, for the decoding steps too. Returns the answer's ids (ending with
    a stop token when one came). With ``last_step`` the last answer token is run through the model
    too, so the sessions have seen every position ``0 .. P + len(answer) - 1``. ``cache``: the
    ``DynamicCache`` to fill (default a :class:`GrowingCache` of prompt + answer; it must keep every
    token in every layer). ``progress``: a bar on stderr counting the generated tokens."""
    model = handle.model
    device = model.device
    session = session or Session()
    steps = steps or session
    session.check(handle.num_layers)
    steps.check(handle.num_layers)
    ids = [int(i) for i in ids]
    if not ids:
        raise InputError("empty prompt: no tokens to generate from")
    check_context(handle, len(ids), decoding)
    stop = set(decoding.stop_ids(handle))
    gen = None                                          # made on the logits' device (the last one under device_map)
    if cache is None:                                   # no config: full layers (module docstring)
        cache = GrowingCache(len(ids) + decoding.max_new_tokens)
    step = torch.tensor([ids], device=device)
    answer: list[int] = []
    kw = {_cache_argument(model): cache}
    bar = tqdm(total=decoding.max_new_tokens, desc="generating", unit="token", leave=False, disable=not progress,
               file=sys.stderr)
    with attngeom_attention_implementation(model), bar:
        while True:
            length = len(ids) + len(answer)
            with (steps if answer else session).active(torch.tensor([length], device=device)):
                out = model(input_ids=step, use_cache=True, logits_to_keep=1, **kw)
            if cache.get_seq_length() != length:    # a model that ignored the cache would see one token a step
                raise RuntimeError(f"the model's KV cache holds {cache.get_seq_length()} tokens after "
                                   f"{length}; attngeom cannot generate with this model")
            done = len(answer) == decoding.max_new_tokens or bool(answer and answer[-1] in stop)
            if done:
                return answer
            logits = out.logits[0, -1].float()
            gen = gen or decoding.generator(logits.device)
            token = decoding.choose(logits, gen)
            answer.append(token)
            bar.update(1)
            if not last_step and (len(answer) == decoding.max_new_tokens or token in stop):
                return answer
            step = torch.tensor([[token]], device=device)


def _cache_argument(model) -> str:
    """The forward's name for the KV cache: ``cache`` (recent transformers 5 releases) or
    ``past_key_values`` (earlier ones)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _answer_as_text(handle: ModelHandleLike, cache, ids: list[int], answer: list[int], session: Session) -> None:
    """Run the answer through the model in one call against the cached prompt, ``session`` active:
    its blocks are rows ``P .. T-1`` of prompt + answer (the cache is cut back to the prompt first)."""
    P = len(ids)
    cached = cache.get_seq_length()
    if cached > P:
        cache.crop(P - cached)                                # a negative count: tokens removed from the end
    model = handle.model
    device = model.device
    with attngeom_attention_implementation(model), session.active(torch.tensor([P + len(answer)], device=device)):
        model(input_ids=torch.tensor([answer], device=device), use_cache=True, logits_to_keep=1,
              **{_cache_argument(model): cache})


class GrowingNorms:
    """Observer put first in a generation's session: per layer it keeps the value norms
    ``‖ṽ_j^h‖`` and ``‖v_j^h‖`` of the tokens already cached and computes only the new tokens' when
    an observer first reads :attr:`~attngeom.capture.blocks.LayerState.value_norm` (or
    ``raw_value_norm``) of a call, then hands the whole vectors to it (a cached token's values never
    change during one generation). Without it every step would recompute every source's
    ``‖ṽ_j^h‖``, an ``H·S·d²`` product per layer and step; a step no observer reads the norms of
    (the answer tables read none) costs nothing: its tokens are added at the next read. The norms
    are :class:`~attngeom.capture.kernel.GrowingTensor` s with room for ``capacity`` tokens (prompt + answer).
    One observer serves one generation at a time: a call with nothing cached before its queries (a
    generation's prompt call) starts a new one, and the norms kept so far are dropped."""

    def __init__(self, capacity: int = 0):
        self.capacity = int(capacity)
        self.norms: dict[int, tuple[GrowingTensor, GrowingTensor]] = {}

    def observe(self, block: Block) -> None:
        st = block.state
        if st.norms is not self:                                 # the call's first block of this layer
            if block.q_start == 0:                               # nothing cached before it: a new generation
                self.norms.pop(st.layer, None)
            st.norms = self                                      # read lazily: LayerState.value_norm calls of()

    def of(self, st) -> tuple[torch.Tensor, torch.Tensor]:
        """``(‖ṽ_j^h‖, ‖v_j^h‖)`` of every source of the call ``st``: ``[B, H, S]`` each."""
        have = self.norms.get(st.layer)
        if have is None or have[0].length > st.num_sources:     # none kept, or more than the call holds
            have = self.norms[st.layer] = (GrowingTensor(-1, self.capacity), GrowingTensor(-1, self.capacity))
        new = st.v_from(have[0].length)                          # the tokens not seen yet, per query head
        return have[0].append(metrics.projected_value_norm(new, st.G)), have[1].append(new.norm(dim=-1))


@dataclass
class GenerationBatch(InputBatch):
    """The :class:`~attngeom.streaming.reducers.InputBatch` reducers see during generation: ``prompt_length``
    tokens of prompt; at ``begin`` ``ids`` is the prompt padded to the longest possible answer, at
    ``end`` prompt + answer."""

    prompt_length: int = 0


@takes_handle
def stream_generation(handle: ModelHandleLike, prompt, reducers: Sequence[Reducer], decoding: Decoding, *,
                      text_reducers: Sequence[Reducer] = (), chat: bool = False, system: str | None = None, layers: Iterable[int] | None = None,
                      block_elements: int | None = None, index: int = 0) -> list[int]:
    """Generate an answer to ``prompt`` (see :func:`prompt_ids`) with ``reducers`` observing
    ``layers`` (default all) at every step; no full maps are kept. Returns prompt + answer ids
    (the reducers saw ``GenerationBatch`` with ``index=[index]``).

    ``text_reducers`` see prompt + answer as a text instead: the prompt's blocks during its forward
    call, then the answer's in one more call against the cached prompt after the generation. Their
    rows are the steps' rows (tests/unit/test_generate.py) and a reducer's Python work is paid per block
    instead of per token and layer: what suits summaries of every position (``HeadStats``,
    ``TokenStats``)."""
    ids = prompt_ids(handle, prompt, chat=chat, system=system, stop=decoding.stop_ids(handle))
    return stream_generation_ids(handle, ids, reducers, decoding, text_reducers=text_reducers, layers=layers,
                                 block_elements=block_elements, index=index)


@takes_handle
def stream_generation_ids(handle: ModelHandleLike, ids: Sequence[int], reducers: Sequence[Reducer], decoding: Decoding,
                          *, text_reducers: Sequence[Reducer] = (), layers: Iterable[int] | None = None,
                          block_elements: int | None = None, index: int = 0, progress: bool = False) -> list[int]:
    """:func:`stream_generation` for a prompt already given as the model's token ids (:func:`prompt_ids`);
    ``progress``: a bar counting the generated tokens."""
    P, N = len(ids), decoding.max_new_tokens
    check_context(handle, P, decoding)
    padded = torch.zeros(1, P + N, dtype=torch.long)
    padded[0, :P] = torch.tensor(ids)
    start = GenerationBatch(ids=padded, lengths=torch.tensor([P + N]), index=[index], prompt_length=P)
    everyone = [*reducers, *text_reducers]
    for r in everyone:
        r.begin(start)
    norms = GrowingNorms(P + N)

    def session(observers):
        return Session(observers=observers, layers=layers, block_elements=block_elements)

    cache = GrowingCache(P + N)
    answer = generate(handle, ids, decoding, session([norms, *everyone]), steps=session([norms, *reducers]),
                      last_step=any(getattr(r, "READS_LAST_TOKEN", True) for r in reducers)
                      or not (reducers or text_reducers),
                      cache=cache, progress=progress)
    if text_reducers:
        _answer_as_text(handle, cache, ids, answer, session([GrowingNorms(P + N), *text_reducers]))
    full = list(ids) + answer
    end = GenerationBatch(ids=torch.tensor([full]), lengths=torch.tensor([len(full)]), index=[index],
                          prompt_length=P)
    for r in everyone:
        r.end(end)
    return full


def answer_prompt_length(batch: InputBatch, reducer: str) -> int:
    """The prompt length of a :class:`GenerationBatch`; an answer table's reducer refuses any other batch."""
    P = getattr(batch, "prompt_length", None)
    if not P:
        raise InputError(f"{reducer} observes generation (attngeom.generation.decoding.stream_generation)")
    return int(P)


def producing_rows(block: Block, prompt_length: int):
    """``(r, q)`` for the block's queries ``q = q_start + r`` that are producing rows (``q >= P - 1``,
    real tokens of batch item 0)."""
    q0, Q = block.q_start, block.shape[2]
    for r in range(max(0, prompt_length - 1 - q0), Q):
        if q0 + r >= int(block.state.lengths[0]):
            return
        yield r, q0 + r


@takes_handle
def generation_stage(handle: ModelHandleLike, run: RunLike, name: str, prompts: Sequence[list[int]], decoding: Decoding,
                     make: Callable[[], Sequence[Reducer]], *, layers: Iterable[int] | None = None,
                     desc: str | None = None, text: int = 0) -> list[Reducer]:
    """Generate an answer to each of ``prompts`` (token ids, :func:`prompt_ids`) with fresh reducers
    ``make()`` observing, as stage ``name`` of ``run`` (an :class:`attngeom.runs.run.Run`: one record
    per prompt, resumable and shared among processes; None: in memory), and return ``make()`` loaded
    with the merged states (as :func:`attngeom.streaming.stages.reduce_stage` does for texts). The decoding
    settings belong in the run's settings: a record is reused only for the same prompt ids. The last
    ``text`` reducers of ``make()`` are ``text_reducers`` (:func:`stream_generation`)."""
    for ids in prompts:
        check_context(handle, len(ids), decoding)
    comm = getattr(run, "comm", None)
    progress = bool(getattr(run, "progress", False)) and (comm is None or comm.rank == 0)

    def work(units: list[int]) -> dict:
        reducers = make()
        cut = len(reducers) - text
        for u in units:
            stream_generation_ids(handle, prompts[u], reducers[:cut], decoding, text_reducers=reducers[cut:], layers=layers,
                        index=u, progress=progress)
        return {str(k): r.state() for k, r in enumerate(reducers)}

    records = run_or_in_memory(run).stage(name, len(prompts), work, desc=desc or name, unit="prompt",
                                      fingerprints=[fingerprint(x) for x in prompts])
    merged = merge_sums(records.values())
    return [r.load_state(merged[str(k)]) for k, r in enumerate(make())]
