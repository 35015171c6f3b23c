"""Corpora for the corpus-level analyses: plain text, WikiText raw files, JSONL, HF datasets.

Every source ends up as a list of token-id windows (:func:`load_windows`): the text is tokenised
once, a BOS token (the sink) is put at the start of each window where the tokenizer has one, and
windows of ``window`` tokens are cut every ``stride`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from .errors import InputError

SAMPLE_TEXT = (
    "Attention weights are often read as a map of what a language model looks at. "
    "But each head mixes value vectors, and those vectors differ in length and in direction. "
    "A token that receives most of the attention can add almost nothing to the output, "
    "while a token with little attention can push the output far along its own direction. "
    "The first token of a sequence is the clearest case: it collects a large share of the "
    "attention in many heads, yet its value points away from the words that carry meaning, "
    "so it suppresses the output instead of filling it. "
    "To see which tokens a head really uses, project every weighted value onto the head's "
    "output and ask how much of that output each token explains."
)
"""The built-in text that ``attngeom analyze`` runs on when no text is given (``make demo``)."""


def read_texts(path: str | Path, fields: Sequence[str] | None = None) -> list[str]:
    """Texts of a corpus file.

    - ``.jsonl``: one JSON object per line; ``fields`` (default ``["text"]``) are joined with a
      newline (``fields=["question", "answer"]`` for GSM8K-style files).
    - anything else: plain text (``fields`` is refused); a WikiText raw file is read as one text
      with its heading markers (`` = Title = ``) kept, as the raw split is usually scored. Line
      endings are normalised to ``\n``.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"data file not found: {p}")
    if p.is_dir():
        raise InputError(f"{p} is a directory; give a text or JSONL file")
    if p.suffix == ".jsonl":
        fields = list(fields or ["text"])
        texts = []
        with p.open("rb") as f:
            for n, raw in enumerate(f, 1):
                where = f"{p}:{n}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InputError(f"{where}: not UTF-8 text") from None
                if not line.strip():
                    continue
                obj = json_object(line, where)
                missing = [k for k in fields if k not in obj]
                if missing:
                    raise InputError(f"{where}: field {missing[0]!r} is missing "
                                     f"(fields present: {', '.join(obj) or 'none'})")
                texts.append("\n".join(str(obj[k]) for k in fields))
    else:
        if fields:
            raise InputError(f"fields ({', '.join(fields)}) apply to .jsonl files and datasets only; "
                             f"{p} is read as plain text")
        try:
            texts = [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError:
            raise InputError(f"{p} is not a UTF-8 text file") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"{p} holds no text")
    return texts


def json_object(line: str, where: str) -> dict:
    """One JSONL line -> a dict, or :class:`InputError` naming ``where`` (``file:line``)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg   # "Invalid control character at"
        raise InputError(f"{where}: not valid JSON at column {e.colno} ({msg})") from None
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")
        raise InputError(f"{where}: expected a JSON object, got {kind}")
    return obj


def read_hf_dataset(name: str, split: str = "test", fields: Sequence[str] | None = None,
                    config: str | None = None) -> list[str]:
    """Texts of a Hugging Face dataset (``hf:NAME[:CONFIG][@SPLIT]`` on the command line).

    Needs the ``datasets`` package and the network; offline it fails at once."""
    import os

    try:
        import datasets
    except ImportError:
        raise InputError("reading a Hugging Face dataset needs `pip install datasets`") from None
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise InputError(f"dataset {name!r} needs the network, but the hub is offline; "
                         "download it elsewhere and pass the file with --data")
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, unknown name
        raise InputError(f"could not load dataset {name!r} ({type(e).__name__}: {e}); "
                         "without the network pass a local file with --data") from None
    fields = list(fields or ["text"])
    missing = [k for k in fields if k not in ds.column_names]
    if missing:
        raise InputError(f"dataset {name!r} has no field {missing[0]!r} (fields: {', '.join(ds.column_names)})")
    return [t for t in ("\n".join(str(row[k]) for k in fields) for row in ds) if t.strip()]


def resolve_texts(spec: str, fields: Sequence[str] | None = None) -> list[str]:
    """``hf:NAME[:CONFIG][@SPLIT]`` -> dataset texts; anything else is a local file."""
    if spec.startswith("hf:"):
        body = spec[3:]
        split = "test"
        if "@" in body:
            body, split = body.split("@", 1)
        name, _, config = body.partition(":")
        return read_hf_dataset(name, split=split, fields=fields, config=config or None)
    return read_texts(spec, fields)


def windows(ids: Sequence[int], window: int, stride: int | None = None, bos: int | None = None,
            max_windows: int | None = None, keep_last: bool = False) -> list[list[int]]:
    """Cut token ids into windows of ``window`` tokens (BOS included when ``bos`` is given); window
    ``k`` starts at ``ids[k·stride]`` (default stride: the window without its BOS, no overlap).

    A text shorter than a window gives one shorter window (when it has at least 2 tokens). A
    shorter last window is dropped (corpora: windows of one length), or kept with ``keep_last`` (a
    single text analysed whole: every token is in a window)."""
    if window < 2:
        raise InputError(f"window must be at least 2 tokens, got {window}")
    body = window - (1 if bos is not None else 0)
    stride = stride or body
    if stride < 1:
        raise InputError(f"stride must be positive, got {stride}")
    out = []
    start = 0
    while start < len(ids):
        chunk = list(ids[start:start + body])
        if bos is not None:
            chunk = [bos] + chunk
        if len(chunk) >= 2 and (len(chunk) == window or not out or keep_last):
            out.append(chunk)
        if max_windows is not None and len(out) >= max_windows:
            break
        if start + body >= len(ids):
            break
        start += stride
    return out


def load_windows(handle, spec: str, window: int = 256, stride: int | None = None,
                 max_windows: int | None = 16, fields: Sequence[str] | None = None) -> list[list[int]]:
    """Token-id windows of a corpus (file or ``hf:`` dataset) for ``handle``'s tokenizer.

    Each text is tokenised without special tokens; each window starts with BOS (the sink) where
    the tokenizer defines one. Raises :class:`InputError` on an empty corpus or a window longer
    than the model's context."""
    limit = getattr(handle, "max_positions", None)
    if limit and window > limit:
        raise InputError(f"--window {window} is longer than the model's context ({limit} tokens)")
    texts = resolve_texts(spec, fields)
    tok = handle.tokenizer
    bos = tok.bos_token_id
    out: list[list[int]] = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if bos is not None and ids and ids[0] == bos:
            ids = ids[1:]
        remaining = None if max_windows is None else max_windows - len(out)
        out.extend(windows(ids, window, stride, bos, remaining))
        if max_windows is not None and len(out) >= max_windows:
            break
    if not out:
        raise InputError(f"{spec} gives no window of at least 2 tokens")
    return out


def parse_int_list(text: str | None, name: str) -> list[int] | None:
    """``"0,5,7"`` -> ``[0, 5, 7]``; ``None``/``"all"`` -> None."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{name} must be a comma-separated list of integers or 'all', got {text!r}") from None


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{name} must be a comma-separated list of numbers, got {text!r}") from None


def check_layers(layers: Iterable[int] | None, num_layers: int) -> list[int] | None:
    if layers is None:
        return None
    layers = list(layers)
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise InputError(f"layer {bad[0]} does not exist: the model has layers 0..{num_layers - 1}")
    return layers
