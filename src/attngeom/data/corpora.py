"""Corpora for the corpus-level analyses: plain text, WikiText raw files, JSONL, CSV, Parquet, a
folder written by ``datasets``' ``save_to_disk``, and Hugging Face hub datasets.

Every source ends up as a list of token-id windows (:func:`load_windows`): the text is tokenised
once, a BOS token (the sink) is put at the start of each window where the tokenizer has one, and
windows of ``window`` tokens are cut every ``stride`` tokens.

Records (JSONL lines, CSV and Parquet rows, dataset rows) follow one rule (:func:`field_text`): a
field is a string, or a number (not a boolean) written as text; a list, an object, binary data, null,
a boolean or a non-finite number is refused with one line naming the file, the line or row, and the field.
A UTF-8 byte-order mark at the start of a file is dropped; a JSONL line nested deeper than
:data:`MAX_DEPTH` levels is refused before it is parsed.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import numbers
import os
import stat
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from attngeom.model.arguments import takes_handle
from attngeom.errors import InputError
from attngeom.runs.contract import ModelHandleLike
from attngeom.runs.storage import MAX_DEPTH, JSONDepthError, json_depth_exceeds, parse_json  # noqa: F401

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

BOM = "\ufeff"
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files by which a folder written by ``datasets``' ``save_to_disk`` is recognised."""
CSV_FIELD_LIMIT = 2 ** (8 * ctypes.sizeof(ctypes.c_long) - 1) - 1
"""The CSV cell size allowed while a CSV file is read: the largest ``csv.field_size_limit`` takes
(a C long), as the whole file is in memory already (the csv module's default is 131,072 characters)."""
TABLE_SUFFIXES = (".jsonl", ".csv", ".parquet")
"""File suffixes read as records with fields (anything else is plain text)."""


def utf8_text(raw: bytes, where: str) -> str:
    """``raw`` decoded as UTF-8 without a leading byte-order mark, or :class:`InputError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where} is not a UTF-8 text file") from None
    return text[1:] if text.startswith(BOM) else text


FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
"""What a path that is neither a regular file nor a directory is called in a refusal."""


def input_path(path: str | Path, what: str = "data file") -> Path:
    """``path`` when it is a regular file or a directory (the caller decides which folders it
    reads), else one :class:`InputError`: not found, a dangling symlink, a symlink loop, or
    something that is not a file (a FIFO, which would block the read forever, a device such as
    ``/dev/zero``, which never ends, a socket). Checked with ``os.stat`` before anything is opened."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        if os.path.islink(p):
            raise InputError(f"{what} {p} is a dangling symlink (its target {os.readlink(p)} does not exist)") from None
        raise InputError(f"{what} not found: {p}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputError(f"{what} {p} is a symlink loop (its links never reach a file)") from None
        raise InputError(f"cannot read {p}: {e.strerror or e}") from None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return p
    kind = next((name for test, name in FILE_KINDS if test(mode)), "not a regular file")
    raise InputError(f"{what} {p} is {kind}, not a file; give a regular file")


def read_texts(path: str | Path, fields: Sequence[str] | None = None) -> list[str]:
    """Texts of a local corpus: one text per record, ``fields`` (default ``["text"]``) joined with a
    newline (``fields=["question", "answer"]`` for GSM8K-style files).

    - ``.jsonl``: one JSON object per line;
    - ``.csv``: a header row naming the fields, one record per row;
    - ``.parquet``: one record per row;
    - a folder written by ``datasets``' ``save_to_disk`` (needs ``pip install attngeom[datasets]``);
    - anything else: plain text (``fields`` is refused); a WikiText raw file is read as one text
      with its heading markers (`` = Title = ``) kept, as the raw split is usually scored. Line
      endings are normalised to ``\n``.
    """
    p = input_path(path)
    if p.is_dir():
        if not any((p / f).is_file() for f in SAVED_DATASET_FILES):
            raise InputError(f"{p} is a directory but not one written by datasets' save_to_disk (it has no "
                             f"{' or '.join(SAVED_DATASET_FILES[:2])}); give a text, JSONL, CSV or Parquet file "
                             "or such a folder")
        texts = _joined(_saved_dataset_rows(p), fields)
    elif p.suffix.lower() in TABLE_SUFFIXES:
        rows = {".jsonl": _jsonl_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}[p.suffix.lower()](p)
        texts = _joined(rows, fields)
    else:
        if fields:
            raise InputError(f"fields ({', '.join(fields)}) apply to .jsonl, .csv and .parquet files and datasets "
                             f"only; {p} is read as plain text")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read {p}: {e.strerror or e}") from None
        texts = [utf8_text(raw, str(p)).replace("\r\n", "\n").replace("\r", "\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"{p} holds no text")
    return texts


def field_text(value, where: str, field: str) -> str:
    """A record's field as text: a string as it is, a number (int or float, not bool) written out;
    anything else is an :class:`InputError` naming ``where`` (``file:line`` or ``file: row n``)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy scalar
        value = value.item()
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            kind = "null (NaN)" if math.isnan(value) else "an infinite number"
        else:
            return str(value)
    else:
        kind = ("a boolean" if isinstance(value, bool) else "null" if value is None
                else "an object" if isinstance(value, dict)
                else "binary data (bytes)" if isinstance(value, (bytes, bytearray, memoryview))
                else "a list" if hasattr(value, "__len__")
                else f"a {type(value).__name__}")
    raise InputError(f"{where}: field {field!r} is {kind}; a field must be a string or a number")


def _joined(rows: Iterable[tuple[str, dict]], fields: Sequence[str] | None) -> list[str]:
    """``(where, record)`` pairs -> one text per record: its ``fields`` joined with newlines."""
    fields = list(fields or ["text"])
    texts = []
    for where, rec in rows:
        missing = [k for k in fields if k not in rec]
        if missing:
            raise InputError(f"{where}: field {missing[0]!r} is missing "
                             f"(fields present: {', '.join(map(str, rec)) or 'none'})")
        texts.append("\n".join(field_text(rec[k], where, k) for k in fields))
    return texts


def _jsonl_rows(p: Path) -> Iterator[tuple[str, dict]]:
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{p}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{where}: not UTF-8 text") from None
            if line.strip():
                yield where, json_object(line, where)


def _csv_rows(p: Path) -> Iterator[tuple[str, dict]]:
    import csv
    import io

    try:
        text = utf8_text(p.read_bytes(), str(p))
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or e}") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    limit = csv.field_size_limit(CSV_FIELD_LIMIT)   # one long document per cell is a normal corpus
    try:
        header = next(reader, None)
        if header is None:
            return
        for row in reader:
            where = f"{p}:{reader.line_num}"
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise InputError(f"{where}: {len(row)} values for {len(header)} columns")
            yield where, dict(zip(header, row))
    except csv.Error as e:
        raise InputError(f"{p}:{reader.line_num}: not valid CSV ({e})") from None
    finally:
        csv.field_size_limit(limit)


def _parquet_rows(p: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(p)
    except ImportError:
        raise InputError("reading Parquet files needs pyarrow (`pip install pyarrow`)") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds for a damaged file
        raise InputError(f"{p} is not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
    for n, rec in enumerate(table.to_pylist(), 1):
        yield f"{p}: row {n}", rec


def _saved_dataset_rows(p: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{p} is a folder written by datasets' save_to_disk; reading it needs "
                         "`pip install attngeom[datasets]`") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001
        raise InputError(f"{p} could not be read as a saved dataset ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):
        splits = sorted(getattr(ds, "keys", lambda: [])())
        raise InputError(f"{p} holds several splits ({', '.join(splits)}); give one split's folder, "
                         f"e.g. {p / (splits[0] if splits else 'train')}")
    for n, rec in enumerate(ds, 1):
        yield f"{p}: row {n}", rec


def corpus_digest(path: str | Path) -> str | None:
    """sha256 of a local corpus: the file's bytes, or for a folder (a saved dataset) the relative
    names and bytes of all its regular files; None when it cannot be read, an :class:`InputError`
    when it is not a file or a folder (:func:`input_path`)."""
    import hashlib

    p = input_path(path)
    h = hashlib.sha256()
    try:
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for q in files:
            if p.is_dir():
                h.update(str(q.relative_to(p)).encode("utf-8") + b"\0")
            with open(q, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def json_object(line: str, where: str) -> dict:
    """One JSONL line -> a dict, or :class:`InputError` naming ``where`` (``file:line``). A leading
    byte-order mark (the first line of a file saved with one) is dropped."""
    if line.startswith(BOM):
        line = line[1:]
    try:
        obj = parse_json(line)
    except JSONDepthError as e:
        raise InputError(f"{where}: {e}") from None
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
        raise InputError("reading a Hugging Face dataset needs `pip install attngeom[datasets]`") from None
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
    texts = _joined(((f"dataset {name!r}: row {n}", row) for n, row in enumerate(ds, 1)), fields)
    return [t for t in texts if t.strip()]


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


@takes_handle
def load_windows(handle: ModelHandleLike, spec: str, window: int = 256, stride: int | None = None,
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


def check_layers(layers: Iterable[int] | None, num_layers: int | None = None,
                 option: str | None = None) -> list[int] | None:
    """The one check of layer numbers, for the command line and the Python API alike: None (all
    layers) stays None; anything else must be whole numbers counted from 0 and, with
    ``num_layers``, below it. A bad one is an :class:`InputError` (``option``, e.g. ``"--layers"``,
    starts its message)."""
    if layers is None:
        return None
    where = f"{option}: " if option else ""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise InputError(f"{where}layers must be a list of layer numbers, not {type(layers).__name__}")
    layers = list(layers)
    odd = [x for x in layers if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
    if odd:
        raise InputError(f"{where}layer {odd[0]!r} is not a layer number (layers are counted 0, 1, 2, ...)")
    layers = [int(x) for x in layers]
    if layers and min(layers) < 0:
        raise InputError(f"{where}layer {min(layers)} does not exist (layers count from 0)")
    bad = [x for x in layers if num_layers is not None and x >= num_layers]
    if bad:
        raise InputError(f"{where}layer {bad[0]} does not exist: the model has layers 0..{num_layers - 1}")
    return layers
