"""The generation options that ``attngeom analyze`` and ``attngeom explore`` share (``--generate N``,
``--sample``, ``--temperature``, ``--top-p``, ``--seed``, ``--chat``, ``--system``) and the prompt
they read: checked before the model is loaded (see :mod:`attngeom.generation.decoding`, docs/generation.md).

A prompt file whose name ends in ``.json`` holds a JSON list of chat messages
(``[{"role": "user", "content": "..."}, ...]``), which always go through the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from attngeom.errors import InputError


def add_generation_args(p) -> None:
    g = p.add_argument_group("generation (analyse the model's own answer to the text, as a prompt)")
    g.add_argument("--generate", type=int, default=None, metavar="N",
                   help="generate up to N tokens after the text (the prompt) and analyse prompt + answer, "
                        "step by step with the KV cache; greedy unless --sample")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the most probable tokens "
                                                             "up to this probability (default 1: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default 0: runs are reproducible)")
    g.add_argument("--chat", action="store_true",
                   help="the text is a user message: put it through the tokenizer's chat template (with --generate "
                        "a --file ending in .json holds a list of chat messages and always goes through it)")
    g.add_argument("--system", default=None, help="a system message (with --chat)")


def decoding_of(args):
    """The :class:`~attngeom.generation.decoding.Decoding` of the options, or None without ``--generate``;
    generation-only options without ``--generate`` are refused."""
    from attngeom.generation.decoding import Decoding

    if args.generate is None:
        given = [o for o, v in (("--sample", args.sample), ("--temperature", args.temperature),
                                ("--top-p", args.top_p), ("--seed", args.seed), ("--chat", args.chat),
                                ("--system", args.system)) if v not in (None, False)]
        if given:
            raise InputError(f"{given[0]} is an option of generation; add --generate N")
        return None
    if args.generate < 1:
        raise InputError(f"--generate must be at least 1, got {args.generate}")
    if args.system is not None and not (args.chat or messages_file(args)):
        raise InputError("--system needs --chat")
    if getattr(args, "window", None) is not None:
        raise InputError("--window does not apply with --generate (the prompt and answer must fit the context)")
    return Decoding(args.generate, sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def messages_file(args) -> bool:
    """Whether ``--file`` names a ``.json`` file of chat messages: with ``--generate`` only (without
    it no chat template applies, and the file is a text like any other)."""
    return (args.generate is not None and bool(getattr(args, "file", None))
            and Path(args.file).suffix.lower() == ".json")


def prompt_of(args, text: str):
    """The prompt: the text, or the chat messages of a ``.json`` prompt file."""
    if messages_file(args):
        from attngeom.runs.storage import JSONDepthError, parse_json

        try:
            messages = parse_json(text)
        except JSONDepthError as e:
            raise InputError(f"{args.file}: {e}; a .json prompt file holds a list of chat messages") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{args.file} is not valid JSON (line {e.lineno}: {e.msg}); a .json prompt file "
                             "holds a list of chat messages") from None
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise InputError(f"{args.file}: a .json prompt file holds a non-empty list of "
                             "{\"role\": ..., \"content\": ...} messages")
        from attngeom.generation.prompts import chat_messages

        chat_messages(messages)                                     # roles and contents checked here
        return messages
    return text


def settings_of(decoding, args) -> dict:
    """What identifies a generation in a run's settings (:func:`attngeom.generation.settings.generation_record`)."""
    from attngeom.generation.settings import generation_record

    return generation_record(decoding, args.chat, args.system)


def note_chat_template(args, handle, command: str, prompt=None) -> None:
    """Say on stderr when a chat prompt goes through attngeom's fallback template (the model's
    tokenizer has none; :data:`attngeom.generation.prompts.FALLBACK_CHAT_TEMPLATE`)."""
    import sys

    from attngeom.generation.prompts import chat_template_of

    chat = args.chat or messages_file(args) or isinstance(prompt, list)
    if chat and chat_template_of(handle) == "fallback":
        print(f"attngeom {command}: {handle.name}'s tokenizer has no chat template; the prompt uses attngeom's "
              "plain fallback template ('User: ...' then 'Assistant:', docs/generation.md)", file=sys.stderr)
