"""File I/O shared by the core and the commands: atomic writes, strict JSON, Parquet, checksums,
and an encoding of numpy arrays and small DataFrames inside JSON records.

What belongs here: bytes on disk and their formats. What does not: run bookkeeping (manifests,
checkpoints, resume; :mod:`attngeom.runs.run`) and anything about figures (:mod:`attngeom.reports`).
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path

from attngeom.errors import OutputError


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsynced and renamed
    in place: a reader sees the old file or the new one, never half of one. Write errors become
    :class:`OutputError` and leave no temporary file."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    replace_atomically(path, write)


def replace_atomically(path: Path, write, what: str | None = None) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path`` (``.NAME.tmp-PID`` plus ``path``'s
    suffix, so a writer that reads the format from the suffix still can), then rename it to ``path``:
    a failed write leaves neither a temporary file nor a half-written ``path``. Write errors become one
    :class:`OutputError` line naming ``what`` (default: ``path``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise OutputError(f"cannot write {what or path}: {e.strerror or e}") from None
    return path


def clean_json(x):
    """``x`` with every non-finite float replaced by None (JSON has no NaN) and numpy scalars and
    arrays turned into Python numbers and lists."""
    import numpy as np

    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return clean_json(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


MAX_DEPTH = 64
"""The deepest nesting of arrays and objects attngeom parses in any JSON it reads (deeper text would
make the parser recurse until Python's stack gives out)."""

_JSON_SYNTAX = re.compile(r'\\.|["\[\]{}]')
"""What decides nesting in JSON text: an escape (two characters), a quote, a bracket or a brace."""


class JSONDepthError(ValueError):
    """JSON text nested deeper than :data:`MAX_DEPTH` levels (refused before it is parsed)."""


def json_depth_exceeds(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the arrays and objects of a JSON text nest deeper than ``limit``, found without
    parsing it: one pass over its quotes, escapes and brackets (brackets inside strings do not
    count), in time linear in the text's length whatever it holds (an unterminated string, say)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, in_string = 0, False
    for m in _JSON_SYNTAX.finditer(text):
        c = m.group()
        if c == '"':
            in_string = not in_string
        elif in_string or len(c) == 2:
            continue
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def parse_json(text: str | bytes, limit: int = MAX_DEPTH):
    """``json.loads(text)`` after the nesting check of :func:`json_depth_exceeds`: too deep is a
    :class:`JSONDepthError`, text that is not JSON a ``json.JSONDecodeError`` (both ValueError);
    bytes must be UTF-8 (else UnicodeDecodeError, a ValueError too)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if json_depth_exceeds(text, limit):
        raise JSONDepthError(f"JSON nested deeper than {limit} levels")
    return json.loads(text)


def dumps(obj, indent: int | None = 2) -> str:
    """Strict JSON (``NaN``/``inf`` written as ``null``)."""
    return json.dumps(clean_json(obj), indent=indent, allow_nan=False, ensure_ascii=False)


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (dumps(obj) + "\n").encode("utf-8"))


def write_parquet(df, path: Path) -> None:
    import io as _io

    buf = _io.BytesIO()
    df.to_parquet(buf, index=False)
    atomic_write_bytes(Path(path), buf.getvalue())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Arrays and frames inside JSON records
# --------------------------------------------------------------------------------------------


def encode_record(x):
    """A JSON-able form of ``x``: numpy arrays (and torch tensors) become
    ``{"__array__": dtype, "shape": [...], "data": base64(zlib(bytes))}``, DataFrames
    ``{"__frame__": {column: encoded column}}``; dicts and lists are encoded item by item; exact
    (bit-for-bit) round trip with :func:`decode_record`."""
    import numpy as np

    if isinstance(x, dict):
        return {str(k): encode_record(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode_record(v) for v in x]
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            return {"__list__": [encode_record(v) for v in x.tolist()]}
        a = np.ascontiguousarray(x)
        return {"__array__": a.dtype.str, "shape": list(a.shape),
                "data": base64.b64encode(zlib.compress(a.tobytes(), 1)).decode("ascii")}
    if type(x).__name__ == "DataFrame":
        return {"__frame__": {str(c): encode_record(x[c].to_numpy()) for c in x.columns}}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return {"__float__": repr(x)}
    return x


def decode_record(x):
    """Inverse of :func:`encode_record`."""
    import numpy as np

    if isinstance(x, list):
        return [decode_record(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__array__" in x:
        raw = zlib.decompress(base64.b64decode(x["data"]))
        return np.frombuffer(raw, dtype=np.dtype(x["__array__"])).reshape(x["shape"]).copy()
    if "__frame__" in x:
        import pandas as pd

        return pd.DataFrame({c: decode_record(v) for c, v in x["__frame__"].items()})
    if "__list__" in x:
        return np.array([decode_record(v) for v in x["__list__"]], dtype=object)
    if "__float__" in x:
        return float(x["__float__"])
    return {k: decode_record(v) for k, v in x.items()}
