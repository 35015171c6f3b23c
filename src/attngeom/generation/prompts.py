"""The prompt a generation answers (SPEC §7; docs/generation.md): a text, token ids or chat messages
-> the ids the model reads (:func:`prompt_ids`), the chat template a model gets (its own, or
:data:`FALLBACK_CHAT_TEMPLATE`; :func:`chat_template_of`, :func:`chat_text`) and the positions the
template put there (:func:`template_positions`)."""

from __future__ import annotations

from typing import Iterable, Sequence

from attngeom.errors import InputError
from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import ModelHandleLike
from attngeom.streaming.passes import check_ids, to_ids


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
