"""Golden "before/after" digest of everything the attngeom CLI writes, on fixed tiny inputs.

Run every CLI command (``python -m attngeom ...``, in subprocesses) on a tiny random Llama (built
here with a fixed seed and saved with ``save_pretrained``) and a tiny corpus written here, then
write a normalised digest of what the runs produced to ``--out`` (JSON):

- per run: the command line (paths relative to the work directory), the exit status, the console
  output (stdout; the ``attngeom ...`` / ``wrote ...`` lines of stderr), the sorted list of every
  file in the output directory (``checkpoint/`` included), and a digest of each output file:
  Parquet/CSV tables (shape, column names, dtypes, every value; floats rounded to 6 significant
  digits), JSON files (``summary.json``, ``claims.json``, ``run.json``, the checkpoint's
  ``settings.json``/``outputs.json``) with their volatile fields replaced by ``"<volatile>"``,
  Markdown reports as lines, PNG figures as their pixel size, ``explore.html`` as its embedded data
  (the binary block of float16 maps decoded and summarised per part);
- the verdict of every claim of ``attngeom claims``.

Only the CLI is used and only its output files are read (no ``import attngeom``), so the same
script runs before and after the package's internals move. ``compare(expected, actual)`` is the
comparison ``test_golden.py`` uses (strings, ints, shapes, file lists exactly; floats with relative
tolerance 1e-4 and absolute 1e-6; numbers printed inside text within their printed precision).

Volatile, and normalised away (machine-, time- or version-dependent; run to run they differ):

- timings: ``runtime_s``, ``seconds*``, ``*_seconds``, ``time_ratio``, ``started``, ``finished`` (JSON
  keys), the ``seconds``/``seconds_per_token``/``time_ratio`` columns of the kvcache tables (their
  values only: the column, its dtype and the row count are kept), "9.9 s"-like times in text;
- versions: ``attngeom_version``, ``versions`` (run.json), "attngeom 0.1.0" in text;
- ``checksum`` (the seals of run.json & co. cover timestamps) and the sha256 of every output file in
  ``run.json``'s ``files`` (Parquet and PNG bytes depend on library versions; the file names stay);
- absolute paths: the work directory is written ``<WORK>``;
- checkpoint record file names ``records-r0-<time>-<pid>.jsonl`` -> ``records-r0-*.jsonl`` (their
  content, the resumable internal records, is not digested).

A later run into an output directory already used (a rerun of a complete run, a run refused for
other settings) is digested as its console lines, the file list and whether it left the outputs as
they were (``outputs_unchanged``, ``files_rewritten``: size or mtime changed), not as a second copy.

Not compared: the bytes of figures (PNG; their pixel size is), the checkpoint's records (internal),
stderr lines other than ``attngeom ...``/``wrote ...`` (library warnings, progress bars).

Determinism: the children run on one thread (OMP/MKL/OpenBLAS), on the CPU, offline, with
PYTHONHASHSEED=0; every random choice of attngeom is seeded. Made twice on this machine (in
different work directories) the digest is byte-for-byte the same. On another CPU (other SIMD
kernels) the last bits move and a few quantities that are differences of nearly equal numbers, or
float32 rounding themselves, move by more than 1e-4: see ``LOOSE_PATHS``. Where ties are decided by
rounding the inputs avoid them (``DISTINCT`` for selection; kvcache compares no two policies that
coincide on this model: streamingllm and taxonomy would, all heads being Reset). Greedy generation
and the top-k sources of explore also rank by value; no near tie showed in these inputs.

Usage::

    python tests/integration/golden/make_golden.py --out digest.json [--work DIR] [--only analyze,claims]
    python tests/integration/golden/make_golden.py --compare expected.json actual.json [--tolerance cross-machine]
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

FORMAT = 1
SEED = 0
MODEL_DIR = "tiny-llama"  # the model's name in every output is its directory's name
REL_TOL, ABS_TOL = 1e-4, 1e-6
F16_REL_TOL = 2e-3  # keys ending in "_f16": statistics of float16 values (2 ulps of float16)

# Tolerances of ``compare(..., loose=True)`` (``--tolerance cross-machine``; the test:
# ATTNGEOM_GOLDEN_TOLERANCE=cross-machine), for comparing digests made on different CPUs. On one
# machine the digest is bit-for-bit the same run to run (one thread, seeded), and the strict
# tolerances above apply. Measured by making the digest with ATEN_CPU_CAPABILITY=default (torch's
# scalar kernels instead of AVX512: every reduction summed in another order) and comparing with the
# AVX512 one: besides 1e-4..1.2e-3 relative differences in quantities that are differences of
# nearly equal numbers (comprehensiveness AOC, single-head dPPL, sink/tail shares, ...), two kinds
# of value are pure float32 rounding and need their own absolute tolerance:
LOOSE_REL_TOL = 2e-3
LOOSE_PATHS = [
    # rho_max at N = 1 is the distance of the one selected point to the selection's own centre, 0,
    # computed as sqrt(clamp(|y|^2 + |s|^2 - 2<s, y>)): the square root of float32 rounding, ~1e-3.
    (re.compile(r"/selection\.parquet/table/data/rho_max\["), LOOSE_REL_TOL, 5e-3),
    # bootstrap percentiles of perplexity differences (~0.05) of policies with perplexities ~500.
    (re.compile(r"/kvcache/outputs/pairs\.parquet/table/data/delta_(low|high)\["), 1e-2, 2e-3),
]
LOOSE_INT_PATHS = [
    # the explorer page's size: its maps are float16 bits compressed, and the last bits of a few maps
    # move between CPUs, and with them the compressed size by a few bytes (the maps themselves are
    # compared decoded, with their tolerance).
    (re.compile(r"/page_bytes$"), 1e-3),
]
SIG_DIGITS = 6
VOLATILE = "<volatile>"

# ---------------------------------------------------------------------------------------------
# Inputs: the tiny model and the corpus files
# ---------------------------------------------------------------------------------------------

BUILD_MODEL = r'''
import sys
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

# The tokenizer and config of tests/tiny_models.py ("llama"): byte-level, one token per character,
# ids 0-3 <pad> <s> </s> <unk>, vocab 128, hidden 64, 3 layers, 4 heads, 2 KV heads (GQA).
def byte_decoder():
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    bs += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}

table = {b: c for c, b in byte_decoder().items()}
chars = [table[b] for b in list(range(33, 127)) + [32, 10, 9]]
vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    pre_tokenizers.Split(Regex("."), behavior="isolated")])
tok.decoder = decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                    unk_token="<unk>", padding_side="right")
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False, attention_bias=False)
torch.manual_seed(int(sys.argv[2]))
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print(repr(sum(float(p.double().sum()) for p in model.parameters())))
'''

CORPUS = """\
The river winds through the valley, past old mills and quiet farms. In spring the water rises and the fields turn green.

A small library stands at the corner of the square. Its shelves hold maps, letters and the diaries of travellers who stopped in the town.

Every evening the baker counts the loaves left on the counter. What is not sold is given to the neighbours before the lamps are lit.

The committee met on Tuesday to discuss the new bridge. Some members wanted stone, others steel; the vote was postponed until the engineers report.
"""

CORPUS_B = """\
def add(a, b):
    return a + b

for i in range(10):
    print(add(i, i * 2))

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y
"""

PROMPTS = [
    {"text": "The capital of the small country is a quiet town by the sea.",
     "prompt": "The capital of the small country is", "reference": " a quiet town by the sea."},
    {"text": "Water boils when it is heated enough.", "prompt": "Water boils when", "reference": " it is heated enough."},
    {"text": "The old map showed a road across the hills.", "prompt": "The old map showed",
     "reference": " a road across the hills."},
]

DISTINCT = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\n"
"""For selection: no character twice in a window. A repeated token has the same value vector at
layer 0, so its attention-scaled values are parallel (cosine distance 0 up to rounding) and which of
them ranks first is decided by the last bits of the kernels, which would make the table flip between
machines."""

BOOLQ = [
    {"passage": "The river rises every spring.", "question": "does the river rise in spring", "answer": True},
    {"passage": "The library has no maps.", "question": "does the library hold maps", "answer": False},
    {"passage": "Bread is sold in the morning.", "question": "is bread sold in the morning", "answer": "true"},
]

TEXT = "The sink collects attention but adds little to the output."
PROMPT = "Tell me a story about"


def write_inputs(work: Path) -> None:
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "corpus.txt").write_text(CORPUS, encoding="utf-8", newline="\n")
    (data / "code.txt").write_text(CORPUS_B, encoding="utf-8", newline="\n")
    (data / "distinct.txt").write_text(DISTINCT, encoding="utf-8", newline="\n")
    for name, rows in (("prompts.jsonl", PROMPTS), ("boolq.jsonl", BOOLQ)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8", newline="\n")


def build_model(work: Path, python: str, env: dict) -> str:
    r = subprocess.run([python, "-c", BUILD_MODEL, str(work / MODEL_DIR), str(SEED)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"building the tiny model failed:\n{r.stderr}")
    return r.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# The runs: every command, smallest settings (paths relative to the work directory)
# ---------------------------------------------------------------------------------------------

M = ["--model", MODEL_DIR, "--device", "cpu"]
RUNS: dict[str, list[str]] = {
    # analyze: one text; --generate on a short prompt; corpus mode (--data, every prompt answered)
    "analyze": ["analyze", *M, "--text", TEXT, "--no-progress", "--out", "runs/analyze"],
    "analyze_options": ["analyze", *M, "--file", "data/code.txt", "--window", "64", "--stride", "48",
                        "--layers", "0,2", "--figure-layers", "2", "--heads", "0,3", "--sink", "0",
                        "--no-progress", "--out", "runs/analyze_options"],
    "analyze_generate": ["analyze", *M, "--text", PROMPT, "--generate", "6", "--no-progress",
                         "--out", "runs/analyze_generate"],
    "analyze_corpus": ["analyze", *M, "--data", "data/prompts.jsonl", "--fields", "prompt", "--generate", "4",
                       "--max-prompts", "3", "--no-progress", "--out", "runs/analyze_corpus"],
    # explore: exact maps; then --generate (seeded sampling) with top-k sources
    "explore": ["explore", *M, "--text", TEXT, "--out", "runs/explore"],
    "explore_generate": ["explore", *M, "--text", PROMPT, "--generate", "4", "--sample", "--seed", "7",
                         "--layers", "0,2", "--top-k", "4", "--exact-max-tokens", "0",
                         "--out", "runs/explore_generate"],
    # faithfulness: perplexity on windows; a multiple-choice task (boolq) by accuracy
    "faithfulness": ["faithfulness", *M, "--data", "data/corpus.txt", "--window", "32", "--max-windows", "2",
                     "--metrics", "attention,contribution,random", "--ratios", "0.25,0.75", "--seeds", "0,1",
                     "--no-progress", "--out", "runs/faithfulness"],
    "faithfulness_task": ["faithfulness", *M, "--data", "data/boolq.jsonl", "--task", "boolq", "--max-examples", "3",
                          "--metrics", "attention,value_weighted", "--ratios", "0.5", "--per-head", "--layers", "1",
                          "--no-progress", "--out", "runs/faithfulness_task"],
    "sinks": ["sinks", *M, "--data", "data/corpus.txt", "--window", "40", "--max-windows", "3",
              "--no-progress", "--out", "runs/sinks"],
    "selection": ["selection", *M, "--data", "data/distinct.txt", "--window", "16", "--max-windows", "2",
                  "--repeats", "2", "--queries", "2", "--no-progress", "--out", "runs/selection"],
    "heads": ["heads", *M, "--data", "data/corpus.txt", "--data", "data/code.txt", "--window", "24",
              "--max-windows", "4", "--calib-windows", "1", "--few-windows", "--no-progress", "--out", "runs/heads"],
    "kvcache": ["kvcache", *M, "--data", "data/corpus.txt", "--window", "40", "--max-windows", "2",
                "--policies", "full,h2o,contribution,taxonomy", "--budgets", "8,16", "--chunk", "2",
                "--calibration-windows", "1", "--answers", "data/prompts.jsonl", "--max-examples", "2",
                "--new-tokens", "3", "--no-progress", "--out", "runs/kvcache"],
    "claims": ["claims", *M, "--data", "data/corpus.txt", "--window", "16", "--max-windows", "5",
               "--calib-windows", "2", "--ratios", "0.3,0.6", "--ns", "2,4", "--repeats", "2",
               "--retentions", "100,75", "--bootstrap", "200", "--no-progress", "--out", "runs/claims"],
    # what a user sees on a rerun and on a refused option (the directory is left untouched)
    "rerun_complete": ["analyze", *M, "--text", TEXT, "--no-progress", "--out", "runs/analyze"],
    "refused_other_settings": ["analyze", *M, "--text", TEXT, "--sink", "1", "--no-progress", "--out", "runs/analyze"],
    "refused_bad_ratio": ["faithfulness", *M, "--data", "data/corpus.txt", "--ratios", "0.5,1.2",
                          "--out", "runs/refused_bad_ratio"],
}
"""Run name -> argv after ``python -m attngeom``. Runs sharing an --out run in this order."""


def child_env() -> dict:
    env = dict(os.environ)
    # one thread (results differ in the last bits with the thread count), no network, no GPU
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[k] = "1"
    env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0",
                "PYTHONIOENCODING": "utf-8", "TQDM_DISABLE": "1", "NO_COLOR": "1"})
    env.pop("ATTNGEOM_TEST_DEVICE", None)
    # torchrun variables would turn a run into a distributed one
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

VOLATILE_KEY = re.compile(r"^(attngeom_version|versions?|runtime(_s)?|started|finished|seconds|seconds_.*|.*_seconds"
                          r"|time_ratio|elapsed.*|duration.*|checksum|hostname|host|pid|python)$")
VOLATILE_COLUMN = re.compile(r"^(seconds|seconds_per_token|time_ratio|.*_seconds|runtime.*|elapsed.*)$")
RECORDS_FILE = re.compile(r"^(records-r\d+)-.*\.jsonl$")
TIME_IN_TEXT = re.compile(r"(?<![\w.])\d+(\.\d+)?( ?)s\b")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class Normaliser:
    def __init__(self, work: Path):
        self.paths = sorted({str(work), str(work.resolve()), str(work.resolve().as_posix())}, key=len, reverse=True)
        self.versions: set[str] = set()

    def text(self, s: str, times: bool = False) -> str:
        for p in self.paths:
            s = s.replace(p, "<WORK>")
        for v in self.versions:
            s = s.replace(f"attngeom {v}", "attngeom <VERSION>")
        if times:
            s = TIME_IN_TEXT.sub(lambda m: f"<T>{m.group(2)}s", s)
        return s

    def json(self, x, key: str | None = None):
        if key is not None and VOLATILE_KEY.match(key):
            return VOLATILE
        if isinstance(x, dict):
            if key == "files" and x and all(isinstance(v, str) and HEX64.match(v) for v in x.values()):
                return {self.text(k): "<sha256>" for k in x}  # run.json: name -> sha256 of the file
            return {self.text(str(k)): self.json(v, str(k)) for k, v in x.items()}
        if isinstance(x, list):
            return [self.json(v) for v in x]
        if isinstance(x, str):
            return self.text(x)
        return value(x)


def round_sig(x: float, digits: int = SIG_DIGITS) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def value(v):
    """A JSON-safe, normalised cell or scalar: floats to 6 significant digits, NaN/inf as strings."""
    import numpy as np

    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isnan(f):
            return "NaN"
        if math.isinf(f):
            return "Infinity" if f > 0 else "-Infinity"
        return round_sig(f)
    if isinstance(v, (bytes, bytearray)):
        return {"bytes_b64": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, np.ndarray):
        return [value(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): value(x) for k, x in v.items()}
    try:
        import pandas as pd

        if v is pd.NA:
            return "<NA>"
        if v is pd.NaT:
            return "<NaT>"
        if isinstance(v, pd.Timestamp):
            return VOLATILE
    except ImportError:  # pragma: no cover
        pass
    return f"<{type(v).__name__}>{v}"


def table_digest(df, norm: Normaliser) -> dict:
    import pandas as pd

    out = {"shape": list(df.shape), "columns": [str(c) for c in df.columns],
           "dtypes": [str(t) for t in df.dtypes]}
    if not isinstance(df.index, pd.RangeIndex) or df.index.start != 0 or df.index.step != 1:
        out["index"] = [value(i) for i in df.index.tolist()]
    data = {}
    for c in df.columns:
        if VOLATILE_COLUMN.match(str(c)):
            data[str(c)] = VOLATILE
            continue
        col = []
        for v in df[c].tolist():
            v = value(v)
            col.append(norm.text(v) if isinstance(v, str) else v)
        data[str(c)] = col
    out["data"] = data
    return out


def png_digest(path: Path) -> dict:
    head = path.read_bytes()[:32]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return {"png": False}
    w, h = struct.unpack(">II", head[16:24])
    return {"png": True, "width": w, "height": h}


EXPLORE_DATA = re.compile(r'<script id="explore-data" type="application/json">(.*?)</script>', re.S)


def explore_digest(path: Path, norm: Normaliser) -> dict:
    """The page's embedded data; its binary block (uint16 words in two byte planes: float16 map
    values ``val``, source codes ``idx``) decoded and summarised per part."""
    import numpy as np

    page = path.read_text(encoding="utf-8")
    m = EXPLORE_DATA.search(page)
    out = {"chars_outside_data": len(page) - (len(m.group(1)) if m else 0)}
    if not m:
        out["data"] = None
        return out
    payload = json.loads(m.group(1))
    raw = zlib.decompress(base64.b64decode(payload.pop("bin", "")))
    n = len(raw) // 2
    words = (np.frombuffer(raw[:n], np.uint8).astype(np.uint16)
             | (np.frombuffer(raw[n:], np.uint8).astype(np.uint16) << 8))
    starts = sorted({off for entries in payload.get("blocks", {}).values() for e in entries for off in e.values()})
    ends = {s: e for s, e in zip(starts, starts[1:] + [n])}
    parts = {}
    for metric, entries in payload.get("blocks", {}).items():
        parts[metric] = []
        for e in entries:
            d = {}
            for kind, off in e.items():
                w = words[off:ends[off]]
                weights = (np.arange(w.size) % 13 + 1).astype(np.float64)
                if kind == "val":
                    v = w.view(np.float16).astype(np.float64)
                    fin = np.isfinite(v)
                    d["val"] = {"n": int(v.size), "nonfinite": int((~fin).sum()),
                                "sum_f16": value(v[fin].sum()), "abs_sum_f16": value(np.abs(v[fin]).sum()),
                                "weighted_sum_f16": value((v[fin] * weights[fin]).sum()),
                                "min_f16": value(v[fin].min()) if fin.any() else None,
                                "max_f16": value(v[fin].max()) if fin.any() else None}
                else:
                    ints = w.astype(np.int64)
                    d[kind] = {"n": int(ints.size), "sum": int(ints.sum()),
                               "weighted_sum": int((ints * weights.astype(np.int64)).sum()),
                               "head": ints[:16].tolist()}
            parts[metric].append(d)
    out["words"] = int(n)
    out["parts"] = parts
    out["data"] = norm.json(payload)
    return out


def text_digest(path: Path, norm: Normaliser) -> list[str]:
    return norm.text(path.read_text(encoding="utf-8"), times=True).split("\n")


def file_digest(path: Path, norm: Normaliser):
    import pandas as pd

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return {"table": table_digest(pd.read_parquet(path), norm)}
    if suffix == ".csv":
        return {"table": table_digest(pd.read_csv(path), norm)}
    if suffix == ".json":
        return {"json": norm.json(json.loads(path.read_text(encoding="utf-8")))}
    if suffix == ".jsonl":
        return {"jsonl_lines": len(path.read_text(encoding="utf-8").splitlines())}
    if suffix == ".png":
        return png_digest(path)
    if suffix == ".html":
        return {"explore": explore_digest(path, norm)}
    if suffix in (".md", ".txt"):
        return {"lines": text_digest(path, norm)}
    return {"bytes": path.stat().st_size}


def listed_name(rel: str) -> str:
    parts = rel.split("/")
    m = RECORDS_FILE.match(parts[-1])
    if m:
        parts[-1] = f"{m.group(1)}-*.jsonl"
    return "/".join(parts)


def console_lines(text: str, norm: Normaliser, keep_all: bool) -> list[str]:
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        line = line.split("\r")[-1].rstrip()  # a progress bar's last state
        if not line:
            continue
        if keep_all or line.startswith(("attngeom", "wrote ")):
            lines.append(norm.text(line, times=True))
    return lines


def out_dir_of(argv: list[str]) -> str | None:
    return argv[argv.index("--out") + 1] if "--out" in argv else None


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def digest_run(work: Path, name: str, argv: list[str], proc, norm: Normaliser, earlier: dict) -> dict:
    """``earlier``: --out -> (run name, outputs digest, snapshot) of the first run writing there; a
    later run in the same directory (a rerun, a refused one) is digested as whether it left the
    outputs as they were (and which files it rewrote), not as a second copy of them."""
    out = out_dir_of(argv)
    d = {"argv": [norm.text(a) for a in argv], "returncode": proc.returncode,
         "stdout": console_lines(proc.stdout, norm, keep_all=True),
         "stderr": console_lines(proc.stderr, norm, keep_all=False)}
    root = work / out if out else None
    if root is None or not root.exists():
        d["files"] = None
        return d
    manifest = root / "run.json"
    if manifest.exists():
        try:
            v = json.loads(manifest.read_text(encoding="utf-8")).get("versions", {}).get("attngeom")
            if v:
                norm.versions.add(v)
                d["stdout"] = console_lines(proc.stdout, norm, keep_all=True)
                d["stderr"] = console_lines(proc.stderr, norm, keep_all=False)
        except (OSError, ValueError):
            pass
    files = sorted(p for p in root.rglob("*") if p.is_file())
    d["files"] = sorted(listed_name(p.relative_to(root).as_posix()) for p in files)
    outputs = {}
    for p in files:
        rel = p.relative_to(root).as_posix()
        if RECORDS_FILE.match(p.name):
            continue
        outputs[rel] = file_digest(p, norm)
    snap = snapshot(root)
    if out in earlier:
        first, first_outputs, first_snap = earlier[out]
        d["same_out_as"] = first
        d["outputs_unchanged"] = outputs == first_outputs
        d["files_rewritten"] = sorted(listed_name(f) for f in set(snap) | set(first_snap)
                                      if snap.get(f) != first_snap.get(f))
    else:
        earlier[out] = (name, outputs, snap)
        d["outputs"] = outputs
    return d


# ---------------------------------------------------------------------------------------------
# Comparison (used by test_golden.py and --compare)
# ---------------------------------------------------------------------------------------------

NUMBER_IN_TEXT = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")


def _printed_ulp(s: str) -> float:
    """The last printed digit's unit: 0 for an integer, 0.01 for "1.23", 1e-7 for "1.23e-05"."""
    mant, _, exp = s.lower().partition("e")
    decimals = len(mant.partition(".")[2]) if "." in mant else None
    if decimals is None and not exp:
        return 0.0
    return 10.0 ** (-(decimals or 0) + (int(exp) if exp else 0))


def _close(a: float, b: float, rel: float, abs_: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _same_text(a: str, b: str, rel: float = REL_TOL) -> bool:
    """Equal, or equal up to numbers printed in them that agree within tolerance plus their printed
    precision (a value near a rounding boundary can print one digit apart)."""
    if a == b:
        return True
    if NUMBER_IN_TEXT.sub("#", a) != NUMBER_IN_TEXT.sub("#", b):
        return False
    for x, y in zip(NUMBER_IN_TEXT.findall(a), NUMBER_IN_TEXT.findall(b)):
        fx, fy = float(x), float(y)
        slack = (_printed_ulp(x) + _printed_ulp(y)) / 2 * 1.0001
        if abs(fx - fy) > max(rel * max(abs(fx), abs(fy)), ABS_TOL) + slack:
            return False
    return True


def _short(x) -> str:
    s = json.dumps(x, ensure_ascii=False)
    return s if len(s) <= 160 else s[:157] + "..."


def compare(expected, actual, loose: bool = False, limit: int = 200) -> list[str]:
    """The differences between two digests, as readable lines (at most ``limit``): strings (up to
    the numbers printed in them), ints, bools, dict keys, list lengths (table shapes, file lists)
    exactly; floats within relative 1e-4 / absolute 1e-6 (``loose``: the cross-machine tolerances
    of :data:`LOOSE_PATHS`, relative :data:`LOOSE_REL_TOL` elsewhere)."""
    diffs: list[str] = []
    _compare(expected, actual, "", diffs, limit, LOOSE_REL_TOL if loose else REL_TOL, ABS_TOL, loose)
    return diffs


def _compare(expected, actual, path: str, diffs: list, limit: int, rel: float, abs_: float, loose: bool) -> None:
    if len(diffs) >= limit:
        return
    where = path or "<root>"
    if isinstance(expected, dict) and isinstance(actual, dict):
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing:
            diffs.append(f"{where}: missing keys {missing}")
        if extra:
            diffs.append(f"{where}: unexpected keys {extra}")
        for k in expected:
            if k in actual:
                sub = f"{path}/{k}"
                r, a = rel, abs_
                if k.endswith("_f16"):
                    r = max(r, F16_REL_TOL)
                if loose:
                    for pattern, pr, pa in LOOSE_PATHS:
                        if pattern.search(sub + "["):
                            r, a = max(r, pr), max(a, pa)
                _compare(expected[k], actual[k], sub, diffs, limit, r, a, loose)
        return
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            if all(isinstance(x, str) for x in expected + actual):  # e.g. a file list
                detail = (f" (missing {_short([x for x in expected if x not in actual])}, "
                          f"unexpected {_short([x for x in actual if x not in expected])})")
            else:
                detail = (f" (expected {_short(expected)}, got {_short(actual)})"
                          if max(len(expected), len(actual)) <= 40 else "")
            diffs.append(f"{where}: length {len(expected)} expected, got {len(actual)}{detail}")
            return
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(e, a, f"{path}[{i}]", diffs, limit, rel, abs_, loose)
            if len(diffs) >= limit:
                break
        return
    if isinstance(expected, bool) or isinstance(actual, bool) or expected is None or actual is None:
        if type(expected) is not type(actual) or expected != actual:
            diffs.append(f"{where}: expected {_short(expected)}, got {_short(actual)}")
        return
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if type(expected) is not type(actual):
            diffs.append(f"{where}: expected {type(expected).__name__} {expected!r}, got "
                         f"{type(actual).__name__} {actual!r}")
        elif isinstance(expected, int):
            slack = next((r for pattern, r in LOOSE_INT_PATHS if pattern.search(path)), 0.0) if loose else 0.0
            if abs(expected - actual) > slack * max(abs(expected), abs(actual)):
                diffs.append(f"{where}: expected {expected}, got {actual}")
        elif not _close(expected, actual, rel, abs_):
            diffs.append(f"{where}: expected {expected!r}, got {actual!r} "
                         f"(rel diff {abs(expected - actual) / max(abs(expected), abs(actual)):.2e})")
        return
    if isinstance(expected, str) and isinstance(actual, str):
        if not _same_text(expected, actual, rel):
            diffs.append(f"{where}: expected {_short(expected)}, got {_short(actual)}")
        return
    diffs.append(f"{where}: expected {type(expected).__name__} {_short(expected)}, "
                 f"got {type(actual).__name__} {_short(actual)}")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def make(work: Path, python: str, only: list[str] | None = None, verbose: bool = True) -> dict:
    env = child_env()
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("runs", "data", MODEL_DIR):
        shutil.rmtree(work / sub, ignore_errors=True)
    write_inputs(work)
    t0 = time.perf_counter()
    weights_sum = build_model(work, python, env)
    if verbose:
        print(f"make_golden: tiny model built ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    norm = Normaliser(work)
    runs, earlier = {}, {}
    names = [n for n in RUNS if only is None or n in only]
    for name in names:
        argv = RUNS[name]
        t = time.perf_counter()
        proc = subprocess.run([python, "-m", "attngeom", *argv], cwd=work, env=env, capture_output=True,
                              text=True, encoding="utf-8", errors="replace", timeout=900)
        runs[name] = digest_run(work, name, argv, proc, norm, earlier)
        if verbose:
            print(f"make_golden: {name}: exit {proc.returncode} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
            if proc.returncode not in (0, 2):
                print(proc.stderr[-3000:], file=sys.stderr)
    verdicts = None
    claims = runs.get("claims", {}).get("outputs", {}).get("claims.json", {}).get("json")
    if claims:
        verdicts = {r["id"]: r["verdict"] for r in claims.get("rows", [])}
    inputs = {"seed": SEED, "weights_sum": round_sig(float(weights_sum)),
              "model_files": sorted(p.name for p in (work / MODEL_DIR).iterdir())}
    return {"format": FORMAT, "inputs": inputs, "runs": runs, "claims_verdicts": verdicts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digest (JSON) here")
    p.add_argument("--work", default=None, help="work directory (default: a temporary one, removed afterwards)")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs python -m attngeom")
    p.add_argument("--only", default=None, help="comma-separated run names (default: all): " + ", ".join(RUNS))
    p.add_argument("--compare", nargs=2, metavar=("EXPECTED", "ACTUAL"), help="compare two digests and exit")
    p.add_argument("--tolerance", choices=("strict", "cross-machine"), default="strict",
                   help="with --compare: strict (default; the same machine) or cross-machine (LOOSE_PATHS)")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(f).read_text(encoding="utf-8")) for f in args.compare)
        diffs = compare(a, b, loose=args.tolerance == "cross-machine")
        for line in diffs:
            print(line)
        print(f"{len(diffs)} difference(s)" + (" (the first 200)" if len(diffs) >= 200 else ""))
        return 1 if diffs else 0
    if not args.out:
        p.error("--out is required (or --compare)")
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    t0 = time.perf_counter()
    if args.work:
        digest = make(Path(args.work).absolute(), args.python, only)
    else:
        with tempfile.TemporaryDirectory(prefix="attngeom-golden-") as tmp:
            digest = make(Path(tmp), args.python, only)
    Path(args.out).write_text(json.dumps(digest, indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                              encoding="utf-8")
    print(f"make_golden: digest written to {args.out} ({time.perf_counter() - t0:.1f} s in all)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
