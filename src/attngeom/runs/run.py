"""The experiment runner every command uses: settings, units, resumable records, atomic outputs.

A **run** lives in one output directory::

    OUT/
      run.json              manifest, written LAST: command, settings, versions, units, files + sha256
      <outputs>             tables, summary.json, figures (moved in from a staging directory)
      .attngeom-lock        held while a process uses the directory (:mod:`attngeom.runs.lock`)
      checkpoint/
        settings.json       the run's identity (command + settings), written when the run starts
        records-*.jsonl     append-only records, one file per process, flushed and fsynced per record
        outputs.json        the output files, written before they are moved into place

``run.json``, ``settings.json`` and ``outputs.json`` are *sealed*: each carries a marker
(``"attngeom": "run"``, ``"run-settings"``, ``"run-outputs"``) and the sha256 of its own canonical
JSON (:func:`seal`). A directory holds an attngeom run only when these files are sealed and intact;
a ``run.json`` of another tool, ``{}``, text that is not JSON or an edited manifest make it a
directory of files that are not an attngeom run. A directory is *complete* only when ``run.json``
is there.

A run is split into **stages** (one pass over the corpus, a removal sweep, ...), each a list of
**units** (windows, examples, heads, ...) numbered ``0..n-1``. :meth:`Run.stage` calls
``work(units)`` for the units not yet recorded and appends one record per call: ``{"stage", "units", "fingerprints", "data"}``. Records are keyed by
unit index, so a rerun resumes where a kill stopped it, and units can be shared out among processes
(:mod:`attngeom.runs.distributed`) and merged: records hold sums, counts and histograms (never means of
means), merged with :func:`merge_sums`. Summaries and figures are computed from the records alone.

Rules of an output directory (checked by :class:`Run` before any compute):

- a new or empty directory starts a run;
- a directory holding a run of the same command with the same settings resumes it (or, when it is
  complete, says so and does nothing);
- a directory holding another command's run, a run with other settings, or files that are not an
  attngeom run is refused with one line (:class:`~attngeom.errors.InputError`) and left untouched,
  unless ``overwrite`` — which replaces an attngeom run, whatever its settings, and starts afresh.
  It removes exactly what that run wrote: the files its manifest (or, for a run killed before its
  manifest, its ``outputs.json``) lists, the checkpoint's own files, staging directories and the
  directories it emptied; any other file in the directory is kept, and files that are not an
  attngeom run are never deleted;
- a directory in use by another process (its lock is held) is refused with one line naming it;
- an output is moved into place only over a file of this run (listed by its manifest or
  ``outputs.json``); a directory, a link or another file in its place is refused in one line
  (:class:`~attngeom.errors.OutputError`) and left as it is;
- outputs are written into ``OUT/.staging-*`` and moved into place, then ``run.json`` is written:
  a kill at any moment leaves either the previous complete state or a directory without ``run.json``
  whose rerun finishes the job. Nothing of an older run is ever mixed with a newer one.

What belongs here: bookkeeping of runs. Not here: model passes (:mod:`attngeom.traces.trace`), the
experiments themselves (their own modules), figures (:mod:`attngeom.reports`), argument parsing
(:mod:`attngeom.commands`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from attngeom.runs import lock as runlock
from attngeom.errors import InputError, OutputError
from attngeom.runs.storage import (clean_json, decode_record, dumps, encode_record, fsync_dir, parse_json, sha256_file,
                                   write_json)

if TYPE_CHECKING:  # pragma: no cover
    from attngeom.runs.contract import RunLike

FORMAT = 2
MANIFEST = "run.json"
CHECKPOINT = "checkpoint"
SETTINGS = "settings.json"
OUTPUTS = "outputs.json"
MARKER = "attngeom"
CHECKSUM = "checksum"
SEALED_KINDS = {MANIFEST: "run", SETTINGS: "run-settings", OUTPUTS: "run-outputs"}
"""The marker of each sealed file of a run, by file name."""


# --------------------------------------------------------------------------------------------
# Communication between processes (one process: everything is trivial)
# --------------------------------------------------------------------------------------------


class SingleProcess:
    """The communication of a one-process run; :mod:`attngeom.runs.distributed` has the real one."""

    rank = 0
    world = 1

    def barrier(self) -> None:
        pass

    def all_gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# Merging records
# --------------------------------------------------------------------------------------------


def merge_sums(parts: Iterable, weights: Sequence[float] | None = None):
    """Add records of sums: numbers and numpy arrays are added (``Σ_k w_k x_k`` with ``weights``),
    dicts key by key (a key missing from a part counts as zero), lists and DataFrames concatenated
    in order (weights must then be whole numbers: a part is repeated ``w`` times, as a bootstrap
    resample would). Returns None for no parts."""
    import numpy as np

    parts = list(parts)
    if weights is None:
        weights = [1] * len(parts)
    parts = [(p, w) for p, w in zip(parts, weights) if w]
    if not parts:
        return None
    first = parts[0][0]
    if isinstance(first, dict):
        keys: list = []
        for p, _ in parts:
            keys += [k for k in p if k not in keys]
        return {k: merge_sums([p[k] for p, _ in parts if k in p], [w for p, w in parts if k in p]) for k in keys}
    if isinstance(first, list):
        out: list = []
        for p, w in parts:
            out += list(p) * int(w)
        return out
    if type(first).__name__ == "DataFrame":
        import pandas as pd

        frames = [p for p, w in parts for _ in range(int(w)) if len(p)]
        return pd.concat(frames, ignore_index=True) if frames else first.iloc[0:0]
    if isinstance(first, (bool, str)) or first is None:
        return first  # a label carried along (all parts agree)
    if isinstance(first, np.ndarray):
        acc = np.zeros_like(first, dtype=np.result_type(first.dtype, np.float64) if any(
            float(w) != int(w) for _, w in parts) else first.dtype)
        for p, w in parts:
            acc = acc + (p * w if w != 1 else p)
        return acc
    return sum(p * w if w != 1 else p for p, w in parts)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class InMemoryRun:
    """A run without an output directory: :meth:`stage` computes every unit in memory, grouped as
    :meth:`Run.stage` groups them (for the Python API and tests; nothing is recorded)."""

    comm = SingleProcess()
    progress = False

    def stage(self, name: str, n_units: int, work: Callable[[list[int]], object], *, group: int = 1,
              group_key: Callable[[int], object] | None = None, units: Sequence[int] | None = None,
              **_) -> dict[tuple[int, ...], object]:
        wanted = list(range(n_units)) if units is None else sorted(set(int(u) for u in units))
        return {tuple(g): work(list(g)) for g in _groups(wanted, max(1, int(group)), group_key)}



def fingerprint(ids) -> int:
    """A digest of a unit's token ids (crc32 of their int64 bytes): records made for other tokens
    are not reused."""
    import zlib

    import numpy as np

    return zlib.crc32(np.asarray(list(ids), dtype=np.int64).tobytes())


def versions() -> dict:
    out = {"python": platform.python_version()}
    try:
        from importlib.metadata import version

        for pkg in ("attngeom", "torch", "transformers"):
            try:
                out[pkg] = version(pkg)
            except Exception:  # pragma: no cover - not installed
                out[pkg] = None
    except Exception:  # pragma: no cover
        pass
    return out


# --------------------------------------------------------------------------------------------
# Sealed files: a marker and the file's own checksum
# --------------------------------------------------------------------------------------------


def _digest(doc: dict) -> str:
    """sha256 of ``doc``'s canonical JSON (sorted keys, no spaces) without its checksum field."""
    body = {k: v for k, v in clean_json(doc).items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal(doc: dict, kind: str) -> dict:
    """``doc`` with the marker ``"attngeom": kind`` and its own checksum: what :func:`unseal` accepts."""
    out = {**clean_json(doc), MARKER: kind}
    out.pop(CHECKSUM, None)
    return {**out, CHECKSUM: _digest(out)}


def unseal(path: Path) -> dict | None | bool:
    """The sealed file ``path`` (its kind is known by its name, :data:`SEALED_KINDS`): the document when
    attngeom wrote it and it is intact, None when there is no such file, False when there is a
    file that is not one (another tool's, ``{}``, not JSON, or changed since)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        doc = parse_json(raw)
    except ValueError:    # not UTF-8, not JSON, nested too deeply
        return False
    if (not isinstance(doc, dict) or doc.get(MARKER) != SEALED_KINDS.get(path.name)
            or doc.get(CHECKSUM) != _digest(doc)):
        return False
    return doc


def read_manifest(out: str | os.PathLike) -> dict | None:
    """The manifest of a complete run in ``out`` (sealed by attngeom and intact), or None."""
    return unseal(Path(out) / MANIFEST) or None


def verify(out: str | os.PathLike) -> list[str]:
    """Problems of a run directory: a missing manifest (or one attngeom did not write), a listed
    file missing or with another checksum. An empty list means the directory is complete and intact."""
    out = Path(out)
    man = read_manifest(out)
    if man is None:
        return [f"{out / MANIFEST} is missing, unreadable or not written by attngeom: the run is not complete"]
    problems = []
    for name, digest in man.get("files", {}).items():
        p = out / name
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(p) != digest:
            problems.append(f"{name} differs from the manifest's checksum")
    return problems


def _identity(command: str, settings: dict) -> dict:
    return {"format": FORMAT, "command": command, "settings": clean_json(settings)}


def _differences(old: dict, new: dict) -> list[str]:
    a, b = old.get("settings") or {}, new.get("settings") or {}
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def run_or_in_memory(run: RunLike | None) -> RunLike:
    """``run`` itself, or an :class:`InMemoryRun` when it is None: every experiment takes ``run=None``
    for a computation in memory (nothing recorded)."""
    return InMemoryRun() if run is None else run


class Run:
    """One run of ``command`` with ``settings`` (JSON-able; they decide whether a directory resumes)
    in ``out``. Claims the directory at once (see the module docstring): raises
    :class:`~attngeom.errors.InputError` for a directory it may not use, before any compute.

    Use as a context manager: a run that fails before recording anything removes the directory it
    created, so failed runs leave no empty output directories.

    ``progress``: show progress bars; ``comm``: the processes sharing the run (default one)."""

    def __init__(self, out: str | os.PathLike, command: str, settings: dict, *, overwrite: bool = False,
                 progress: bool = True, comm=None):
        self.out = Path(out)
        self.command = command
        self.settings = clean_json(dict(settings))
        self.identity = _identity(command, self.settings)
        self.overwrite = bool(overwrite)
        self.progress = bool(progress)
        self.comm = comm or SingleProcess()
        self.started = time.time()
        self.created = False
        self.resumed = False
        self.complete = False
        self._writer: Path | None = None
        self._locked = False
        self._records: dict[str, dict[tuple[int, ...], dict]] = {}
        self.units_done: dict[str, int] = {}
        self.units_total: dict[str, int] = {}
        self._check_agreement()
        # the first process claims the directory; the others learn what it found
        error = None
        if self.comm.rank == 0:
            try:
                self._claim()
            except (InputError, OutputError) as e:
                error = e
        found = self.comm.broadcast({"error": [type(error).__name__, str(error)] if error else None,
                                     "complete": self.complete, "resumed": self.resumed})
        if error:
            raise error
        if found["error"]:
            kind, msg = found["error"]
            raise (InputError if kind == "InputError" else OutputError)(msg)
        self.complete, self.resumed = found["complete"], found["resumed"]
        self.comm.barrier()
        self._load_records()

    # -- paths ----------------------------------------------------------------------------------
    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT

    # -- claiming the directory ------------------------------------------------------------------
    def _check_agreement(self) -> None:
        """Every process must have been started with the same command and settings."""
        if self.comm.world == 1:
            return
        mine = dumps(self.identity, indent=None)
        all_ids = self.comm.all_gather(mine)
        if any(x != all_ids[0] for x in all_ids):
            bad = [r for r, x in enumerate(all_ids) if x != all_ids[0]]
            diff = _differences(json.loads(all_ids[0]), json.loads(all_ids[bad[0]]))
            raise InputError(f"processes were started with different settings (rank {bad[0]} differs from "
                             f"rank 0 in: {', '.join(diff) or 'the command'}); start every rank with the "
                             "same arguments")

    def _owner(self) -> dict | None:
        """The identity of the attngeom run in the directory, None when there is none; an
        :class:`InputError` when its run files are not ones attngeom wrote (see :func:`unseal`)."""
        found = []
        for p in (self.checkpoint / SETTINGS, self.out / MANIFEST):
            doc = unseal(p)
            if doc is False:
                raise InputError(f"{self.out} holds files that are not an attngeom run "
                                 f"({p.relative_to(self.out)} was not written by this version of attngeom, or was "
                                 "changed since); use a new or empty directory (nothing was changed)")
            if doc:
                found.append({"format": doc.get("format"), "command": doc.get("command"),
                              "settings": doc.get("settings")})
        if len(found) == 2 and found[0] != found[1]:
            raise InputError(f"{self.out} holds files that are not an attngeom run ({MANIFEST} and "
                             f"{CHECKPOINT}/{SETTINGS} name different runs); use a new or empty directory "
                             "(nothing was changed)")
        return found[0] if found else None

    def _claim(self) -> None:
        """Create or take ``out`` under its lock (:mod:`attngeom.runs.lock`), then apply the rules of
        the module docstring. A refusal leaves the directory as it was."""
        out = self.out
        if (out.exists() or out.is_symlink()) and not out.is_dir():
            raise OutputError(f"--out {out} is {_what_is(out)}, not a directory")
        try:
            out.mkdir(parents=True)
            self.created = True
        except FileExistsError:
            if not out.is_dir():
                raise OutputError(f"--out {out} is {_what_is(out)}, not a directory") from None
        except OSError as e:
            raise OutputError(f"cannot write to output directory {out}: {e.strerror or e}") from None
        runlock.acquire(out)
        self._locked = True
        try:
            self._take()
        except BaseException:
            if self.created:
                shutil.rmtree(out, ignore_errors=True)
            self.close()
            raise

    def _take(self) -> None:
        out = self.out
        owner = self._owner()
        if owner is not None:
            if self.overwrite:
                self._remove_run()
            elif owner == self.identity:
                self.resumed = True
                self.complete = read_manifest(out) is not None and not verify(out)
            else:
                if owner.get("command") != self.command:
                    what = f"an attngeom {owner.get('command')} run"
                else:
                    diff = _differences(owner, self.identity)
                    what = f"an attngeom {self.command} run with other settings ({', '.join(diff) or 'format'})"
                raise InputError(f"{out} holds {what}; use another --out, or --overwrite to replace it "
                                 "(nothing was changed)")
        elif self._other_files():
            raise InputError(f"{out} is not empty and holds no attngeom run; use a new or empty directory "
                             "(nothing was changed)")
        try:
            self.checkpoint.mkdir(exist_ok=True)
            for stale in out.glob(".staging-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if not (self.checkpoint / SETTINGS).exists():
                write_json(self.checkpoint / SETTINGS, seal({**self.identity, "started": _now()}, SEALED_KINDS[SETTINGS]))
        except OSError as e:
            raise OutputError(f"cannot write to output directory {out}: {e.strerror or e}") from None

    def _other_files(self) -> bool:
        """Whether the directory holds anything besides the lock, staging directories and an empty
        checkpoint directory."""
        for p in self.out.iterdir():
            if p.name == runlock.LOCK or p.name.startswith(".staging-"):
                continue
            if p == self.checkpoint and p.is_dir() and not any(p.iterdir()):
                continue
            return True
        return False

    def _remove_run(self) -> None:
        """Delete exactly what the attngeom run in the directory wrote: the files its manifest lists
        and those its ``outputs.json`` lists (moved into place by a run killed before its manifest),
        the checkpoint's own files, staging directories, the manifest, and the directories this left
        empty. Nothing else is touched."""
        out = self.out
        names: set[str] = set()
        for doc in (read_manifest(out), unseal(self.checkpoint / OUTPUTS)):
            if doc:
                names.update(str(n) for n in (doc.get("files") or ()))
        emptied: set[Path] = {self.checkpoint}
        root = out.resolve()
        try:
            for name in sorted(names):
                p = _inside(out, name)
                if p is None or not (p.parent.resolve() == root or root in p.parent.resolve().parents):
                    continue  # a directory on the way was replaced by a link out of the run
                if p.is_file() or p.is_symlink():
                    p.unlink()
                    emptied.add(p.parent)
            own = [self.checkpoint / n for n in (SETTINGS, OUTPUTS)] + [out / MANIFEST]
            own += [q for pat in ("records-*.jsonl", f".{SETTINGS}.tmp-*", f".{OUTPUTS}.tmp-*")
                    for q in self.checkpoint.glob(pat)]
            own += list(out.glob(f".{MANIFEST}.tmp-*"))
            for q in own:
                if q.is_file():
                    q.unlink()
            for stale in out.glob(".staging-*"):
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale)
            for d in sorted(emptied, key=lambda d: len(d.parts), reverse=True):
                while d != out and out in d.parents and d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
                    d = d.parent
        except OSError as e:
            raise OutputError(f"cannot remove the run in {out}: {e.strerror or e}") from None

    def close(self) -> None:
        """Give up the directory's lock (done when the run finishes, when its ``with`` block ends,
        and when the object is collected)."""
        if getattr(self, "_locked", False):
            self._locked = False
            runlock.release(self.out)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- context manager: remove what a failed run created ---------------------------------------
    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None or exc_type is KeyboardInterrupt:
                return
            if self.comm.rank == 0 and self.created and not self._has_records():
                shutil.rmtree(self.out, ignore_errors=True)
        finally:
            self.close()

    def _has_records(self) -> bool:
        return any(p.stat().st_size > 0 for p in self.checkpoint.glob("records-*.jsonl")) if self.checkpoint.is_dir() else False

    # -- records -----------------------------------------------------------------------------------
    def _load_records(self) -> None:
        self._records = {}
        if not self.checkpoint.is_dir():
            return
        for path in sorted(self.checkpoint.glob("records-*.jsonl")):
            with path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = parse_json(line)
                        key = tuple(int(u) for u in rec["units"])
                        stage = str(rec["stage"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a kill
                    self._records.setdefault(stage, {}).setdefault(key, rec)

    def _append(self, rec: dict) -> None:
        if self._writer is None:
            name = f"records-r{self.comm.rank}-{int(self.started * 1000)}-{os.getpid()}.jsonl"
            self._writer = self.checkpoint / name
        data = json.dumps(rec, allow_nan=False) + "\n"
        try:
            with self._writer.open("a", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"cannot append to {self._writer}: {e.strerror or e}") from None

    def stage(self, name: str, n_units: int, work: Callable[[list[int]], object], *, group: int = 1,
              group_key: Callable[[int], object] | None = None, fingerprints: Sequence | None = None,
              desc: str | None = None, unit: str = "unit",
              units: Sequence[int] | None = None) -> dict[tuple[int, ...], object]:
        """Records of every unit of stage ``name``: ``{units: data}`` ordered by first unit.

        ``work(units)`` computes the data (sums, counts, tables; see :func:`attngeom.runs.storage.encode_record`) of
        up to ``group`` units at once; it is called only for units without a record, and only for this
        process's share of them (every ``world``-th missing unit). ``fingerprints[u]`` (e.g. a digest
        of the unit's token ids) is stored with the record, and a record whose fingerprints differ is
        computed again. ``group_key(u)``: units with different keys never share a call (e.g. the
        variants of different windows). ``units``: compute only these unit indices (default all)."""
        wanted = list(range(n_units)) if units is None else sorted(set(int(u) for u in units))
        fp = (lambda u: None) if fingerprints is None else (lambda u: fingerprints[u])
        have: dict[tuple[int, ...], object] = {}
        covered: set[int] = set()
        for key, rec in self._records.get(name, {}).items():
            if all(0 <= u < n_units for u in key) and list(rec.get("fingerprints") or [None] * len(key)) == [fp(u) for u in key]:
                if covered.isdisjoint(key):
                    have[key] = rec
                    covered.update(key)
        missing = [u for u in wanted if u not in covered]
        mine = missing[self.comm.rank::self.comm.world]
        groups = _groups(mine, max(1, int(group)), group_key)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(wanted), initial=len(wanted) - len(missing), desc=desc or name, unit=unit,
                   disable=not self.progress or self.comm.rank != 0, file=sys.stderr)
        new: dict[tuple[int, ...], dict] = {}
        for g in groups:
            data = work(list(g))
            rec = {"stage": name, "units": list(g), "fingerprints": [fp(u) for u in g], "data": encode_record(data)}
            self._append(rec)
            new[tuple(g)] = rec
            bar.update(len(g) * self.comm.world)
        bar.close()
        if self.comm.world > 1:
            for part in self.comm.all_gather(new):
                for key, rec in part.items():
                    have.setdefault(key, rec)
        else:
            have.update(new)
        self._records.setdefault(name, {}).update(have)
        self.units_total[name] = len(wanted)
        self.units_done[name] = sum(len(k) for k in have if set(k) <= set(wanted))
        out = {}
        for key in sorted(have, key=lambda k: k[0]):
            if set(key) & set(wanted):
                out[key] = decode_record(have[key]["data"])
        return out

    def units(self) -> dict[str, dict[str, int]]:
        """Units recorded per stage (``done``) and asked for in this process (``total``)."""
        out = {}
        for name, recs in sorted(self._records.items()):
            done = len({u for key in recs for u in key})
            out[name] = {"done": self.units_done.get(name, done), "total": self.units_total.get(name, done)}
        return out

    # -- finishing ---------------------------------------------------------------------------------
    def finish(self, write: Callable[[Path], Sequence[str]], extra: dict | None = None) -> list[str]:
        """Write the outputs: ``write(staging)`` puts files (names relative to ``staging``) into a
        staging directory and returns their names; they are moved into ``out`` and ``run.json`` is
        written last. Only the first process writes; the others wait. Returns the file names."""
        files: list[str] = []
        if self.comm.rank == 0:
            staging = self.out / f".staging-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            try:
                staging.mkdir()
                files = [str(f) for f in write(staging)]
                self._check_destinations(files)
                self._list_outputs(files)
                (self.out / MANIFEST).unlink(missing_ok=True)
                fsync_dir(self.out)
                for f in files:
                    dst = self.out / f
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / f, dst)
                fsync_dir(self.out)
            except OSError as e:
                raise OutputError(f"cannot write the outputs into {self.out}: {e.strerror or e}") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            manifest = {
                **self.identity,
                "complete": True,
                "versions": versions(),
                "world_size": self.comm.world,
                "units": self.units(),
                "started": _now(self.started),
                "finished": _now(),
                "seconds": round(time.time() - self.started, 1),
                "files": {f: sha256_file(self.out / f) for f in files},
                **(extra or {}),
            }
            write_json(self.out / MANIFEST, seal(manifest, SEALED_KINDS[MANIFEST]))
            self.complete = True
        self.comm.barrier()
        self.close()
        return files

    def _check_destinations(self, files: Sequence[str]) -> None:
        """Refuse (:class:`OutputError`, before anything is moved) an output whose place in ``out``
        holds something attngeom did not write there: a directory, a link, a special file, or a
        file no manifest or ``outputs.json`` of this run lists. Moving the output in would delete it."""
        ours: set[str] = set()
        for doc in (read_manifest(self.out), unseal(self.checkpoint / OUTPUTS)):
            if doc:
                ours.update(str(n) for n in (doc.get("files") or ()))
        for f in files:
            dst = _inside(self.out, f)
            if dst is None or not (dst.exists() or dst.is_symlink()):
                continue
            if dst.is_symlink() or not dst.is_file():
                kind = "a link" if dst.is_symlink() else "a directory" if dst.is_dir() else "not a regular file"
            elif f not in ours:
                kind = "a file this run did not write"
            else:
                continue
            raise OutputError(f"{dst} is {kind}; attngeom would replace it with its output {f}: move it away and "
                              "rerun (nothing was changed)")

    def _list_outputs(self, files: Sequence[str]) -> None:
        """Record the output files in ``checkpoint/outputs.json`` before they are moved into place,
        so that ``--overwrite`` can remove them even when no manifest gets written."""
        bad = [f for f in files if _inside(self.out, f) is None]
        if bad:
            raise OutputError(f"output name {bad[0]!r} is not a path inside {self.out}")
        prior = unseal(self.checkpoint / OUTPUTS) or {}
        listed = sorted(set(prior.get("files") or ()) | set(files))
        write_json(self.checkpoint / OUTPUTS, seal({"files": listed}, SEALED_KINDS[OUTPUTS]))


def _what_is(path: Path) -> str:
    """What stands at ``path`` in place of a directory, for a one-line refusal."""
    if path.is_symlink() and not path.exists():
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a symlink loop"
        return f"a dangling symlink (its target {os.readlink(path)} does not exist)"
    return "a file" if path.is_file() else "neither a file nor a directory"


def _inside(out: Path, name: str) -> Path | None:
    """``out / name`` when ``name`` is a relative path that stays inside ``out``, else None."""
    rel = Path(name)
    if rel.is_absolute() or not rel.parts or ".." in rel.parts:
        return None
    return out / rel


def _groups(units: Sequence[int], size: int, key: Callable[[int], object] | None) -> list[list[int]]:
    """Consecutive runs of at most ``size`` units with one ``key``."""
    out: list[list[int]] = []
    for u in units:
        if out and len(out[-1]) < size and (key is None or key(out[-1][0]) == key(u)):
            out[-1].append(u)
        else:
            out.append([u])
    return out


def _now(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))
