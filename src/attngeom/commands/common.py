"""Pieces shared by the commands: common options, the run (output directory), model loading.

A command is thin: it checks its arguments (everything that needs no model, before any compute),
says what identifies its run and hands the rest to :func:`run_command`, which opens the
:class:`~attngeom.runs.run.Run` (claiming the output directory), lets the command load the model and
call an experiment of the core, writes the outputs through :meth:`~attngeom.runs.run.Run.finish` and prints the result.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from attngeom.errors import InputError
from attngeom.runs.contract import layers_identity  # noqa: F401  (for the commands)
from attngeom.runs.storage import write_json, write_parquet

if TYPE_CHECKING:  # pragma: no cover
    from attngeom.runs.contract import RunLike


class Outputs:
    """The one way a command writes: every file of its run goes through this helper, into the run's
    staging folder (:meth:`~attngeom.runs.run.Run.finish` moves them into ``--out``, all or
    nothing), and :attr:`files` lists their names in the order written (report.md lists them so)."""

    def __init__(self, staging: Path, args=None):
        self.staging, self.args, self.files = Path(staging), args, []

    def _add(self, name: str) -> Path:
        self.files.append(name)
        return self.staging / name

    def table(self, name: str, df) -> None:
        """``<name>.parquet``, as given."""
        write_parquet(df, self._add(f"{name}.parquet"))

    def tables(self, tables: dict, names=None, model: str | None = None) -> None:
        """``tables[name]`` for each of ``names`` (default: all) as ``<name>.parquet``; with
        ``model``, a first column ``model`` (the tables in ``tables`` get it too: the figures read them)."""
        for t in tables if names is None else names:
            if model is not None:
                df = tables[t].copy()
                df.insert(0, "model", model)
                tables[t] = df
            self.table(t, tables[t])

    def text(self, name: str, text: str) -> None:
        """A UTF-8 text file (``\n`` line ends)."""
        self._add(name).write_text(text, encoding="utf-8", newline="\n")

    def json(self, name: str, obj) -> None:
        write_json(self._add(name), obj)

    def written(self, name: str, write) -> None:
        """A file that ``write(path)`` writes in a format of its own (e.g. JSONL examples)."""
        write(self._add(name))

    def figures(self, report: str) -> list[str]:
        """The figures of ``attngeom.reports.<report>`` (its ``render(staging, fmt)``, which reads
        the tables written before, in ``--figure-format``). Returns their names."""
        import importlib

        render = importlib.import_module(f"..reports.{report}", __package__).render
        names = draw(lambda: render(self.staging, figure_format(self.args)), self.args)
        self.files += names
        return names

    def report(self, command: str, summary: dict, model: str | None = None, markdown: str | None = None) -> list[str]:
        """``report.md`` last: ``markdown`` as given, or :func:`attngeom.reports.run_report.render` of
        ``command``'s ``summary`` listing every file written (itself included). Returns the file names."""
        from attngeom.reports.run_report import render

        self.files.append("report.md")
        text = markdown if markdown is not None else render(command, summary, self.files, model)
        (self.staging / "report.md").write_text(text, encoding="utf-8")
        return list(self.files)


def write_outputs(staging: Path, tables: dict, names, model_name: str | None, summary: dict,
                  report: str | None, args=None, before=None) -> list[str]:
    """An experiment command's outputs through :class:`Outputs`: what ``before(out)`` writes first
    (e.g. examples), its tables (with a first column ``model`` when ``model_name`` is given), the
    figures of ``attngeom.reports.<report>`` (listed in ``summary["figures"]``; none when ``report``
    is None), then ``summary.json`` and ``report.md``. Returns the file names."""
    out = Outputs(staging, args)
    if before is not None:
        before(out)
    out.tables(tables, names, model_name)
    if report is not None:
        write_json(Path(staging) / "summary.json", summary)    # the figures name what they rest on from it
        summary["figures"] = out.figures(report)
    out.json("summary.json", summary)
    return out.report(summary["command"], summary, model_name)


def add_figure_args(p, no_figures: bool = True) -> None:
    """``--figure-format`` (and ``--no-figures``) of a command that draws."""
    p.add_argument("--figure-format", default="png",
                   help="file format of the figures: png (default), pdf, svg, or any other format matplotlib "
                        "writes (eps, ps, jpg, tiff, webp, ...)")
    if no_figures:
        p.add_argument("--no-figures", action="store_true", help="write tables, summary and report only")


def figure_format(args) -> str:
    """``--figure-format``, checked (before any compute when called early): one-line error when
    matplotlib does not write it."""
    from attngeom.reports.common import check_format

    return check_format(getattr(args, "figure_format", None) or "png")


def draw(render, args) -> list[str]:
    """Run ``render()`` (returns the figure paths) with a line on stderr while it draws (figures take
    seconds); returns the file names."""
    quiet = args is None or getattr(args, "no_progress", False)
    if not quiet:
        print("attngeom: drawing figures ...", file=sys.stderr, flush=True)
    return [Path(p).name for p in render()]


def add_model_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="model spec: 'smollm2-135m' (bundled, default), 'gemma3-270m' (bundled, optional), "
                        "a .gguf file, a local HF model directory, or a hub id (needs the network)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present; "
                                                   "under torchrun each process takes its local GPU)")
    p.add_argument("--allow-missing-weights", action="store_true",
                   help="load a checkpoint whose weights do not fill the model its config.json describes "
                        "(those weights are random; recorded in the run's settings); default: refused")


def add_data_args(p, required: bool = True, repeat: bool = False, window: int = 256, max_windows: int = 16) -> None:
    p.add_argument("--data", required=required, action="append" if repeat else "store",
                   help="corpus: a text file, WikiText raw file, .jsonl/.csv/.parquet file, a folder written by "
                        "datasets' save_to_disk, or hf:NAME[:CONFIG][@SPLIT]")
    p.add_argument("--fields", default=None, help="JSONL/CSV/Parquet/dataset fields joined per record, e.g. question,answer")
    p.add_argument("--window", type=int, default=window, help="tokens per window, BOS included (default %(default)s)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: no overlap)")
    p.add_argument("--max-windows", type=int, default=max_windows, help="windows to use (default %(default)s)")


def add_out_arg(p, default: str | None = None) -> None:
    p.add_argument("--out", required=default is None, default=default,
                   help="output directory" + (f" (default {default})" if default else ""))
    p.add_argument("--overwrite", action="store_true",
                   help="replace the attngeom run already in --out (another command's, or one with other "
                        "settings) instead of refusing; a run with the same settings always resumes")


def add_text_args(p, verb: str) -> None:
    """``--text`` / ``--file`` (default: the built-in sample text) for the one-text commands."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help=f"the text to {verb} (default: the built-in sample text)")
    src.add_argument("--file", default=None, help=f"read the text to {verb} from this UTF-8 file (kept as written)")


def text_input(args, verb: str) -> tuple[str, str]:
    """``(text, source)`` of ``--text`` / ``--file`` / the built-in sample, checked before any
    compute: an empty text, a missing, unreadable, non-UTF-8 or empty file are one-line errors. A
    file is read as written (``\r`` stays ``\r``)."""
    from attngeom.data.corpora import SAMPLE_TEXT, input_path, utf8_text

    if args.text is not None:
        if not args.text.strip():
            raise InputError(f"--text is empty (or only whitespace); give some text to {verb}")
        return args.text, "--text"
    if args.file is None:
        return SAMPLE_TEXT, "built-in sample text (attngeom.data.corpora.SAMPLE_TEXT)"
    p = input_path(args.file, "input file")
    if p.is_dir():
        raise InputError(f"{p} is a directory; give a text file")
    try:
        text = utf8_text(p.read_bytes(), str(p))
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or e}") from None
    if not text.strip():
        raise InputError(f"{p} is empty (or only whitespace); give some text to {verb}")
    return text, str(p)


def run_identity(args, settings=None, **inputs) -> dict:
    """A run's identity, built one way by every command: the model (:func:`model_identity`), what
    the run reads (``inputs``: the corpus, the text, ...) and ``settings.identity()`` (each
    settings dataclass says what of it identifies a run)."""
    return {**model_identity(args), **inputs, **({} if settings is None else settings.identity())}


def text_identity(text: str, source: str) -> dict:
    return {"text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "source": source}


def add_progress_arg(p) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def fields_of(args) -> list[str] | None:
    return [f.strip() for f in args.fields.split(",") if f.strip()] if getattr(args, "fields", None) else None


def check_at_least(args, **minimums: int) -> None:
    """Refuse an option below its minimum, e.g. ``check_at_least(args, window=3, max_windows=1)``
    (options left unset, None, are not checked)."""
    for name, low in minimums.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise InputError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def check_layer_list(spec, option: str = "--layers") -> list[int] | None:
    """``all``/None -> None, else a non-empty list of layer numbers (``","`` and negative numbers are
    refused; the model's own range is checked by :func:`attngeom.data.corpora.check_layers` once it is loaded)."""
    from attngeom.data.corpora import check_layers, parse_int_list

    layers = parse_int_list(spec, option)
    if layers is not None and not layers:
        raise InputError(f"{option} names no layer")
    return check_layers(layers, option=option)


def data_identity(spec: str) -> dict:
    """What identifies a corpus in a run's settings: the resolved path and its content's sha256
    (a changed file is another run), or the ``hf:`` spec as given."""
    from attngeom.data.corpora import corpus_digest

    if spec.startswith("hf:"):
        return {"data": spec}
    digest = corpus_digest(spec)       # first: a path that is no file or folder is refused here
    return {"data": str(Path(spec).resolve()), "data_sha256": digest}


def model_identity(args) -> dict:
    """``--model``, ``--dtype`` and ``--device`` normalised without loading anything: an explicit
    ``--dtype float32`` on CPU is the same run as the default. Bad devices fail here (exit 2).
    ``--allow-missing-weights`` is recorded when given, and torch's thread count always: sums over
    another number of threads differ in their last bits, so a run resumed under another
    ``OMP_NUM_THREADS`` is another run (docs/runs.md)."""
    import torch

    from attngeom.runs.distributed import local_device
    from attngeom.model.device import check_device, dtype_name, resolve_dtype

    device = check_device(getattr(args, "device", None) or local_device())
    dtype = resolve_dtype(getattr(args, "dtype", None), device)
    spec = args.model
    if Path(spec).exists():  # a local file or directory: the same run from any working directory
        spec = str(Path(spec).resolve())
    out = {"model": spec, "dtype": dtype_name(dtype), "device_type": device.type, "threads": torch.get_num_threads()}
    if getattr(args, "allow_missing_weights", False):
        out["allow_missing_weights"] = True
    return out


def corpus_identity(args, fields: list[str] | None, data: dict | None = None) -> dict:
    """What identifies a corpus command's input (``inputs`` of :func:`run_identity`): the corpus
    (:func:`data_identity` of ``--data``, or ``data`` as given), its ``--fields`` and how it is cut
    into windows (``--window``, ``--stride``, ``--max-windows``)."""
    return {**(data_identity(args.data) if data is None else data), "fields": fields,
            "window": args.window, "stride": args.stride, "max_windows": args.max_windows}


def open_run(args, command: str, settings: dict):
    """The :class:`~attngeom.runs.run.Run` of this command in ``--out`` (claimed before any compute),
    shared among the processes of a ``torchrun`` launch when there is one."""
    from attngeom.runs.distributed import comm_from_env
    from attngeom.runs.run import Run

    comm = comm_from_env(getattr(args, "device", None))
    try:
        return Run(args.out, command, settings, overwrite=getattr(args, "overwrite", False),
                   progress=not getattr(args, "no_progress", False), comm=comm)
    except BaseException:
        comm.close()
        raise


def run_command(args, command: str, identity: dict, work) -> int:
    """The sequence every command shares, after its options are checked: open the run of ``command``
    in ``--out`` with ``identity`` (:func:`open_run`; the run's settings in run.json), stop when it
    is already complete (:func:`already_complete`), else ``work(run)``, which loads the model, runs
    the experiment and returns ``(write, report)``: ``write(staging)`` writes the outputs and returns
    their file names (:meth:`~attngeom.runs.run.Run.finish`), ``report(out, files)`` prints the result, on rank 0 only,
    once the run is closed. Returns the exit status, 0."""
    with open_run(args, command, identity) as run:
        if already_complete(run, command):
            return 0
        write, report = work(run)
        files = run.finish(write)
    if run.comm.rank == 0:
        report(run.out, files)
    return 0


def already_complete(run: RunLike, command: str) -> bool:
    """Say so when ``--out`` already holds this complete run (nothing is recomputed or rewritten)."""
    if run.complete:
        if run.comm.rank == 0:
            print(f"attngeom {command}: {run.out} already holds this complete run (run.json); nothing to do "
                  "(--overwrite recomputes it)", file=sys.stderr)
        return True
    return False


def load(args):
    """Load the model named by ``--model`` (with a note on stderr: the first load of a bundled model
    dequantises it once). Each warning of the load is one line on stderr."""
    import warnings

    from attngeom.runs.distributed import local_device, rank
    from attngeom.model import load_model

    quiet = getattr(args, "no_progress", False) or rank() != 0
    if not quiet:
        print(f"attngeom: loading {args.model} ...", file=sys.stderr)
    device = getattr(args, "device", None) or local_device()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        handle = load_model(args.model, dtype=getattr(args, "dtype", None), device=device, progress=not quiet,
                            allow_missing_weights=getattr(args, "allow_missing_weights", False))
    for w in caught:
        if rank() == 0:
            print(f"attngeom: warning: {w.message}", file=sys.stderr)
    return handle
