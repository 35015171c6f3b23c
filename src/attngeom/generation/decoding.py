"""Generation with analysis: the model's own answer to a prompt, captured step by step with its KV cache
(SPEC §7; docs/generation.md).

- :func:`prompt_ids` — a text, token ids or a list of chat messages -> the ids the model reads
  (``chat=True``: through the tokenizer's chat template as a user message, ``system`` optional).
- :class:`Decoding` — how tokens are chosen: greedy (default) or sampling with ``temperature``,
  ``top_p`` and a ``seed`` (reproducible); stop tokens.
- :func:`generate` — the decoding loop alone: every forward call runs through the capture plug-in
  with a :class:`~attngeom.capture.plugin.Session`, so its observers see the prompt's blocks and then one
  one-query block per layer and step (SPEC §1-2: the same ``a_ij^h``, ``v_j^h`` and metrics).
- :func:`stream_generation` — reducers over the generation, at every step, or as ``text_reducers`` over prompt +
  answer as a text (the answer in one call against the cached prompt); no ``T x T`` map kept.
- :func:`attngeom.traces.trace.analyze_generation` (``attngeom.analyze(model, prompt, generate=N)``) — a
  full :class:`~attngeom.traces.trace.Trace` of prompt + answer (``trace.prompt_length``,
  ``trace.generated``) whose maps are the per-step rows, built from :func:`stream_generation_ids` here.
- :class:`AnswerSources` — per generated token its top prompt sources and where its contribution
  comes from (prompt, earlier answer, sink), per layer and for the model; :func:`generation_stage`
  runs prompts through an :class:`attngeom.runs.run.Run` (resumable, data-parallel).

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

import sys

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from attngeom.model.arguments import takes_handle
from attngeom.capture.plugin import Block, GrowingTensor, Session, attngeom_attention_implementation
from attngeom.errors import InputError
from attngeom.metrics import formulas as metrics
from attngeom.runs.contract import ModelHandleLike, RunLike
from attngeom.streaming.reducers import InputBatch, Reducer

DEFAULT_TOP_K = 5
"""Prompt sources listed per generated token and metric in :class:`AnswerSources`."""
TABLE_METRICS = ("attention", "contribution")
"""Token-level scores (SPEC §2) of the answer tables: mean attention over heads, ``C_ij = Σ_h C_ij^h``."""


# --------------------------------------------------------------------------------------------
# The prompt
# --------------------------------------------------------------------------------------------


def chat_messages(prompt, system: str | None = None) -> list[dict]:
    """A user text (plus ``system``) or a list of ``{"role", "content"}`` messages, checked."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("the prompt is empty (or only whitespace)")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise InputError("chat messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for k, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"chat message {k} needs a string 'role' and a string 'content'")
    if system is not None:
        if messages[0]["role"] == "system":
            raise InputError("the messages already start with a system message; leave out --system")
        messages.insert(0, {"role": "system", "content": system})
    return messages


@takes_handle
def prompt_ids(handle: ModelHandleLike, prompt, *, chat: bool = False, system: str | None = None,
               stop: Iterable[int] = ()) -> list[int]:
    """The token ids the model reads for ``prompt``.

    - a text, ``chat=False``: :meth:`~attngeom.model.ModelHandle.encode` (BOS in front);
    - a text with ``chat=True``, or a list of chat messages (always through the template): the
      tokenizer's chat template (:data:`FALLBACK_CHAT_TEMPLATE` when it has none), rendered with
      the generation prompt (or continuing the final message when it is the assistant's), then
      tokenized without adding anything (:func:`chat_text`);
    - token ids: taken as they are.

    ``stop``: token ids that end generation; one inside the user's own text (a message's content,
    or the plain prompt) is refused: the model would read an end of text in the middle of the
    prompt. The special tokens a chat template puts between messages are the model's format and
    are not checked; neither are token-id prompts."""
    tok = handle.tokenizer
    messages = None
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        messages = chat_messages(prompt, system)
    elif chat:
        if not isinstance(prompt, str):
            raise InputError("chat=True takes a text or a list of chat messages, not token ids")
        messages = chat_messages(prompt, system)
    elif system is not None:
        raise InputError("a system message needs chat=True (--chat)")
    from attngeom.streaming.passes import check_ids, to_ids

    if messages is None:
        if not isinstance(prompt, str):
            return to_ids(handle, prompt)
        _check_no_stop(handle, [prompt], stop)
        return check_ids(handle, handle.encode(prompt))
    _check_no_stop(handle, [m["content"] for m in messages], stop)
    ids = [int(i) for i in tok(chat_text(handle, messages), add_special_tokens=False)["input_ids"]]
    if not ids:
        raise InputError("the chat template produced no tokens")
    return check_ids(handle, ids)


FALLBACK_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
                          "{% if add_generation_prompt %}Assistant:{% endif %}")
"""The chat template used for a tokenizer that has none (the bundled Gemma 3 270M, a base model):
each message as ``Role: content`` and a blank line, then ``Assistant:``. Plain text, no special
tokens; the model was not trained on it. :func:`chat_template_of` says which template a model gets."""


@takes_handle
def chat_template_of(handle: ModelHandleLike) -> str:
    """``"model"`` when the tokenizer has its own chat template, else ``"fallback"``
    (:data:`FALLBACK_CHAT_TEMPLATE`)."""
    return "model" if getattr(handle.tokenizer, "chat_template", None) else "fallback"


@takes_handle
def chat_text(handle: ModelHandleLike, messages: list[dict]) -> str:
    """The checked ``messages`` (:func:`chat_messages`) rendered by the model's chat template (or
    :data:`FALLBACK_CHAT_TEMPLATE`), with the generation prompt, or continuing the final message when
    it is the assistant's."""
    cont = messages[-1]["role"] == "assistant"
    template = None if chat_template_of(handle) == "model" else FALLBACK_CHAT_TEMPLATE
    try:
        return handle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                                    continue_final_message=cont, chat_template=template)
    except Exception as e:  # jinja errors of the template itself (e.g. roles it does not accept)
        raise InputError(f"the chat template refused the messages: {str(e).splitlines()[0][:200]}") from None


@takes_handle
def template_positions(handle: ModelHandleLike, prompt, *, chat: bool = False, system: str | None = None) -> tuple[int, ...]:
    """The positions of :func:`prompt_ids` that the chat template put there: every token none of
    whose characters comes from a message's content (role names, separators, turn markers, the
    generation prompt). Found from the tokenizer's character offsets in the rendered text (the
    contents are located in order); a tokenizer without offsets marks nothing. A prompt given as
    text without ``chat`` or as ids has no template tokens (its BOS is a special token)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        messages = chat_messages(prompt, system)
    elif chat and isinstance(prompt, str):
        messages = chat_messages(prompt, system)
    else:
        return ()
    text = chat_text(handle, messages)
    spans, at = [], 0
    for m in messages:
        k = text.find(m["content"], at) if m["content"] else -1
        if k >= 0:
            spans.append((k, k + len(m["content"])))
            at = k + len(m["content"])
    try:
        offsets = handle.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return ()
    return tuple(p for p, (a, b) in enumerate(offsets)
                 if not any(a < e and s < max(b, a + 1) for s, e in spans))


def _check_no_stop(handle: ModelHandleLike, texts: Sequence[str], stop: Iterable[int]) -> None:
    stop = set(int(s) for s in stop)
    if not stop:
        return
    for text in texts:
        ids = handle.tokenizer(text, add_special_tokens=False)["input_ids"]
        hit = [i for i in ids if int(i) in stop]
        if hit:
            raise InputError(f"the prompt holds the stop token {handle.tokens([hit[0]])[0]!r} (id {hit[0]}), which "
                             "ends generation; the model would read it as an end of text inside the prompt")


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


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


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
    """A full-attention cache layer whose keys and values are :class:`~attngeom.capture.plugin.GrowingTensor` s:
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
    from tqdm.auto import tqdm

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
    import inspect

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
    an observer first reads :attr:`~attngeom.capture.plugin.LayerState.value_norm` (or
    ``raw_value_norm``) of a call, then hands the whole vectors to it (a cached token's values never
    change during one generation). Without it every step would recompute every source's
    ``‖ṽ_j^h‖``, an ``H·S·d²`` product per layer and step; a step no observer reads the norms of
    (the answer tables read none) costs nothing: its tokens are added at the next read. The norms
    are :class:`~attngeom.capture.plugin.GrowingTensor` s with room for ``capacity`` tokens (prompt + answer).
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


# --------------------------------------------------------------------------------------------
# Answer tables
# --------------------------------------------------------------------------------------------


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


def rows_by_device(rows: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Rows ``[k, n_i]`` joined along their last dimension, one tensor per device (the layers of a
    model split by ``device_map`` live on several): ``[(indices of the rows, joined), ...]``, each
    joined tensor on its rows' device, so that each device's rows reach the host in one copy."""
    at: dict[torch.device, list[int]] = {}
    for i, row in enumerate(rows):
        at.setdefault(row.device, []).append(i)
    return [(idx, torch.cat([rows[i] for i in idx], dim=1)) for idx in at.values()]


class AnswerSources(Reducer):
    """Where each generated token's producing row (module docstring) draws from, per layer and
    for the model (the mean of the analysed layers' rows), from the token-level scores of SPEC §2
    (``attention``: mean over heads of ``a_ij^h``; ``contribution``: ``C_ij = Σ_h C_ij^h``, which
    sums to 1 over ``j``). Only producing rows are computed (:func:`~attngeom.metrics.formulas.received_row`, no map).

    :meth:`result` gives three tables (one row per generated token unless said):

    - ``shares``: ``step``, ``position``, ``token_id``, ``layer`` (null: the model), ``query``
      (the producing row), and per metric ``{metric}_sink`` (the sink), ``{metric}_prompt`` (the
      other prompt tokens) and ``{metric}_answer`` (earlier answer tokens, the query included when
      it is one); the three sum to the row's total (1 for contribution and attention).
    - ``sources``: the ``top_k`` sources by each metric, prompt and earlier answer tokens alike (the
      sink left out: it has its own share; so are the positions ``exclude`` (or ``{text: positions}``)
      and the tokens ``exclude_ids``, e.g. chat-template and special tokens): ``metric``, ``rank`` (0 first),
      ``source``, ``source_id``, ``score``; ties: the earlier position first. Each row is ranked
      when the next forward call (or block) begins; an answer token in ``exclude_ids`` (known only at the end) is then left out of the
      lists, which keeps the order of the rest but may leave such a row fewer than ``top_k`` sources.
    - ``summary``: per layer (null: the model) and prompt position, each metric's mean over the
      answer's producing rows: which prompt tokens the whole answer drew on."""

    STATE = ("shares", "sources", "summary")
    READS_LAST_TOKEN = False                                  # the last token's row produces nothing

    def __init__(self, sink: int = 0, top_k: int = DEFAULT_TOP_K, exclude=(), exclude_ids: Iterable[int] = ()):
        self.sink, self.top_k = int(sink), int(top_k)
        self.exclude, self.exclude_ids = exclude, set(int(i) for i in exclude_ids)
        self.shares: list[pd.DataFrame] = []
        self.sources: list[pd.DataFrame] = []
        self.summary: list[pd.DataFrame] = []

    def begin(self, batch: InputBatch) -> None:
        from attngeom.generation.heads import of_text

        super().begin(batch)
        self.P = answer_prompt_length(batch, type(self).__name__)
        prompt_ids = batch.ids[0, :self.P].tolist()
        # left out of the rankings: the sink (it has its share), the excluded positions, prompt tokens in exclude_ids
        left_out = {self.sink, *of_text(self.exclude, batch.index[0]),
                    *(j for j, t in enumerate(prompt_ids) if t in self.exclude_ids)}
        self._left_out_at = np.array(sorted(left_out), dtype=np.int64)
        self._reset()

    def _reset(self) -> None:
        # Each producing row [metrics, q + 1] (float64) is reduced soon after it is observed, so the
        # state grows by a few numbers per row, not by the row: the per-layer shares and top sources,
        # the running sum over layers that becomes the model's row, and per layer the sum of the
        # prompt columns over the rows known to be producing (the rows of the latest query wait in
        # _pending: only the end says whether it is the last token's, which produces nothing).
        # The rows of one forward call wait on the device in _step and are reduced together, all
        # layers at once: one copy to the host and a few array operations per decoding step.
        self._step: list[tuple[int, int, int, torch.Tensor]] = []           # (layer, query, first source, row)
        self._tables: dict[tuple[int, int], tuple] = {}                     # (layer, query) -> shares, top sources
        self._layer_sum: dict[int, np.ndarray] = {}                        # query -> Σ_layers row
        self._layer_count: dict[int, int] = {}
        self._summary: dict[tuple, list] = {}                              # layers -> [Σ_queries rows[:, :, :P], count]
        self._pending: dict[int, list[tuple[tuple, np.ndarray]]] = {}      # query -> [(layers, rows)]

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        if self._step and block.layer <= self._step[-1][0]:                # a new forward call (or block)
            self._flush()
        for r, q in producing_rows(block, self.P):
            got = metrics.received_row(block.a[0, :, r], block.pulled_back[0, :, r], block.output_sq[0, r],
                                       block.group_values[0])        # [TABLE_METRICS, S]
            n = min(S, q + 1 - block.k_start)                        # sources up to the query
            self._step.append((block.layer, q, block.k_start, got[:, :n]))

    def _flush(self) -> None:
        """Reduce the waiting rows: one copy to the host per device, then per query all its layers'
        rows at once."""
        step, self._step = self._step, []
        if not step:
            return
        host: list = [None] * len(step)
        for at, joined in rows_by_device([got for *_, got in step]):
            parts = np.split(joined.cpu().numpy(), np.cumsum([step[i][3].shape[1] for i in at])[:-1], axis=1)
            for i, part in zip(at, parts):
                host[i] = part                                               # [TABLE_METRICS, n]
        by_query: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for (layer, q, k0, _), row in zip(step, host):
            by_query.setdefault(q, []).append((layer, k0, row))
        for q, items in by_query.items():
            rows = np.zeros((len(items), len(TABLE_METRICS), q + 1))
            for i, (_, k0, row) in enumerate(items):
                rows[i, :, k0:k0 + row.shape[1]] = row
            self._add_rows(q, tuple(layer for layer, *_ in items), rows)

    def _add_rows(self, q: int, layers: tuple, rows: np.ndarray) -> None:
        """The rows ``[len(layers), metrics, q + 1]`` of query ``q``: their tables now, their sums."""
        shares, top, m = self._shares(rows, q), self._top(rows.reshape(-1, q + 1)), len(TABLE_METRICS)
        for i, layer in enumerate(layers):
            self._tables[(layer, q)] = (shares[i], top[i * m:(i + 1) * m])
        self._layer_sum[q] = rows.sum(0) + self._layer_sum.get(q, 0.0)
        self._layer_count[q] = self._layer_count.get(q, 0) + len(layers)
        for earlier in [k for k in self._pending if k < q]:               # a later query came: producing rows
            self._commit(earlier)
        self._pending.setdefault(q, []).append((layers, rows))

    def _commit(self, q: int) -> None:
        """Add the query's pending rows to their layers' summary sums."""
        for layers, rows in self._pending.pop(q):
            have = self._summary.setdefault(layers, [0.0, 0])
            have[0] = have[0] + rows[:, :, :self.P]
            have[1] += 1

    def _summary_means(self) -> dict[int, np.ndarray]:
        """Per layer the mean of its committed rows' prompt columns: ``{layer: [metrics, P]}``."""
        sums: dict[int, list] = {}
        for layers, (total, count) in self._summary.items():
            for i, layer in enumerate(layers):
                have = sums.setdefault(layer, [0.0, 0])
                have[0], have[1] = have[0] + total[i], have[1] + count
        return {layer: total / count for layer, (total, count) in sums.items()}

    def end(self, batch: InputBatch) -> None:
        T, P, index = int(batch.lengths[0]), self.P, batch.index[0]
        ids = batch.ids[0, :T].tolist()
        answer_left_out = {j for j in range(P, T) if ids[j] in self.exclude_ids}
        self._flush()
        layers = sorted({l for l, _ in self._tables})
        queries = range(P - 1, T - 1)                             # the last token produced nothing
        for q in [k for k in self._pending if k < T - 1]:
            self._commit(q)
        if layers and len(queries):
            model_rows = {q: self._layer_sum[q] / self._layer_count[q] for q in queries}
            means = self._summary_means()
            means[None] = np.mean([model_rows[q][:, :P] for q in queries], axis=0)
            shares, sources, summary = [], [], []
            for layer in [*layers, None]:
                for q in queries:
                    step = q + 1 - P
                    base = {"text": index, "step": step, "position": q + 1, "token_id": ids[q + 1], "layer": layer,
                            "query": q}
                    row_shares, top = (self._tables[(layer, q)] if layer is not None
                                       else (self._shares(model_rows[q], q), self._top(model_rows[q])))
                    shares.append({**base, **self._shares_dict(row_shares)})
                    for m, (at, score) in zip(TABLE_METRICS, top):
                        ranked = [(int(j), float(x)) for j, x in zip(at, score) if j not in answer_left_out]
                        sources += [{**base, "metric": m, "rank": r, "source": j, "source_id": ids[j], "score": x}
                                    for r, (j, x) in enumerate(ranked)]
                mean = means[layer]                                                # [metrics, P]
                summary.append(pd.DataFrame({"text": index, "layer": layer, "position": np.arange(P),
                                             "token_id": ids[:P], **{m: mean[k] for k, m in enumerate(TABLE_METRICS)}}))
            self.shares.append(_nullable_layer(pd.DataFrame(shares)))
            self.sources.append(_nullable_layer(pd.DataFrame(sources)))
            self.summary.append(_nullable_layer(pd.concat(summary, ignore_index=True)))
        self._reset()

    def _shares(self, rows: np.ndarray, q: int) -> np.ndarray:
        """Each metric's ``(sink, prompt, answer)`` shares of rows ``[..., metrics, q + 1]``: ``[..., metrics, 3]``."""
        P, sink = self.P, self.sink
        s = rows[..., sink] if sink <= q else np.zeros(rows.shape[:-1])
        out = np.stack([s, rows[..., :P].sum(-1), rows[..., P:].sum(-1)], axis=-1)
        if sink <= q:
            out[..., 1 if sink < P else 2] -= s                 # the sink is neither prompt nor answer
        return out

    def _shares_dict(self, shares: np.ndarray) -> dict:
        return {f"{m}_{part}": float(shares[k, i]) for k, m in enumerate(TABLE_METRICS)
                for i, part in enumerate(("sink", "prompt", "answer"))}

    def _top(self, rows: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row of ``rows [R, n]`` (one metric each) its ``top_k`` sources (not left out) and their
        scores, the highest first, ties the earlier position first: ``[(positions, scores)] * R``.
        All rows at once: only what can rank is sorted (each row's k-th largest and above; a row
        with a NaN, all of it), by row, score and position."""
        keep = np.ones(rows.shape[1], dtype=bool)
        keep[self._left_out_at[self._left_out_at < rows.shape[1]]] = False
        cand, k_top = np.flatnonzero(keep), self.top_k
        scores = rows[:, cand]                                               # [R, m]
        if len(cand) > k_top:
            kth = np.partition(scores, len(cand) - k_top, axis=1)[:, len(cand) - k_top]
            can_rank = (scores >= kth[:, None]) | np.isnan(scores).any(1, keepdims=True)
        else:
            can_rank = np.ones(scores.shape, dtype=bool)
        r, c = np.nonzero(can_rank)
        order = np.lexsort((c, -scores[r, c], r))
        r, c = r[order], c[order]
        rank = np.arange(len(r)) - np.searchsorted(r, r)                     # place within its row
        r, c = r[rank < k_top], c[rank < k_top]
        bounds = np.searchsorted(r, np.arange(len(rows) + 1))
        return [(cand[c[b0:b1]], scores[r[b0:b1], c[b0:b1]]) for b0, b1 in zip(bounds[:-1], bounds[1:])]

    def result(self) -> dict[str, pd.DataFrame]:
        """The three tables; ``layer`` is a nullable integer (null: the model) however the state travelled."""
        return {name: (_nullable_layer(pd.concat(getattr(self, name), ignore_index=True)) if getattr(self, name)
                       else pd.DataFrame()) for name in self.STATE}


def _nullable_layer(df: pd.DataFrame) -> pd.DataFrame:
    if "layer" in df:
        df["layer"] = pd.array([None if pd.isna(x) else int(x) for x in df["layer"]], dtype="Int64")
    return df


class Answers(Reducer):
    """The generated text of each prompt (``answers`` table: ``text``, ``prompt_tokens``,
    ``answer_tokens``, ``stopped`` (ended on a stop token), ``answer_ids`` (space-separated))."""

    STATE = ("answers",)
    READS_LAST_TOKEN = False

    def __init__(self, stop: Iterable[int] = ()):
        self.stop = set(int(s) for s in stop)
        self.answers: list[pd.DataFrame] = []

    def observe(self, block: Block) -> None:
        pass

    def end(self, batch: InputBatch) -> None:
        T, P = int(batch.lengths[0]), int(batch.prompt_length)
        answer = batch.ids[0, P:T].tolist()
        self.answers.append(pd.DataFrame([{
            "text": batch.index[0], "prompt_tokens": P, "answer_tokens": len(answer),
            "stopped": bool(answer) and answer[-1] in self.stop, "answer_ids": " ".join(map(str, answer))}]))

    def result(self) -> pd.DataFrame:
        return pd.concat(self.answers, ignore_index=True) if self.answers else pd.DataFrame()


@takes_handle
def generation_stage(handle: ModelHandleLike, run: RunLike, name: str, prompts: Sequence[list[int]], decoding: Decoding,
                     make: Callable[[], Sequence[Reducer]], *, layers: Iterable[int] | None = None,
                     desc: str | None = None, text: int = 0) -> list[Reducer]:
    """Generate an answer to each of ``prompts`` (token ids, :func:`prompt_ids`) with fresh reducers
    ``make()`` observing, as stage ``name`` of ``run`` (an :class:`attngeom.runs.run.Run`: one record
    per prompt, resumable and shared among processes; None: in memory), and return ``make()`` loaded
    with the merged states (as :func:`attngeom.traces.trace.reduce_stage` does for texts). The decoding
    settings belong in the run's settings: a record is reused only for the same prompt ids. The last
    ``text`` reducers of ``make()`` are ``text_reducers`` (:func:`stream_generation`)."""
    from attngeom.runs.run import fingerprint, merge_sums, run_or_in_memory

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
