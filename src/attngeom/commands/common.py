"""Pieces shared by the commands: common options, output directory, model loading, atomic writes."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import InputError, OutputError


def add_model_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="model spec: 'smollm2-135m' (bundled, default), a .gguf file, a local HF model "
                        "directory, or a hub id (needs the network)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")


def add_data_args(p, required: bool = True, repeat: bool = False) -> None:
    p.add_argument("--data", required=required, action="append" if repeat else "store",
                   help="corpus: a text file, WikiText raw file, .jsonl file, or hf:NAME[:CONFIG][@SPLIT]")
    p.add_argument("--fields", default=None, help="JSONL/dataset fields joined per record, e.g. question,answer")
    p.add_argument("--window", type=int, default=256, help="tokens per window, BOS included (default 256)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: no overlap)")
    p.add_argument("--max-windows", type=int, default=16, help="windows to use (default 16)")


def add_out_arg(p, default: str | None = None) -> None:
    p.add_argument("--out", required=default is None, default=default, help="output directory")


def fields_of(args) -> list[str] | None:
    return [f.strip() for f in args.fields.split(",") if f.strip()] if getattr(args, "fields", None) else None


def check_at_least(args, **minimums: int) -> None:
    """Refuse an option below its minimum, e.g. ``check_at_least(args, window=3, max_windows=1)``
    (options left unset, None, are not checked)."""
    for name, low in minimums.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise InputError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def prepare_out(path: str | os.PathLike) -> Path:
    """Create the output directory and prove it is writable, before any compute."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-", delete=True):
            pass
    except OSError as e:
        raise OutputError(f"cannot write to output directory {out}: {e.strerror or e}") from None
    return out


def load(args):
    """Load the model named by ``--model`` (with a note on stderr: the first load of the bundled model
    dequantises it once, ~35 s)."""
    from ..model import load_model

    print(f"attngeom: loading {args.model} ...", file=sys.stderr)
    return load_model(args.model, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=_json_default) + "\n").encode())


def write_parquet(df, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _json_default(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
