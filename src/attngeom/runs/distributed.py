"""Data-parallel runs on ``torch.distributed``: the communication :class:`~attngeom.runs.run.Run` uses.

Launch any corpus command under ``torchrun`` (or ``accelerate launch``, which sets the same
environment)::

    torchrun --nproc_per_node 2 -m attngeom sinks --data corpus.txt --out runs/sinks

Every process loads the model (on GPU: its local device ``cuda:$LOCAL_RANK``), the runner shares out
the units not yet recorded by unit index (process ``r`` of ``n`` takes every ``n``-th), each process
appends its own records to the run's checkpoint, and after each stage the records are exchanged
(``all_gather_object``) so every process continues with all of them; process 0 alone writes the
outputs. Backend: ``nccl`` when the processes use CUDA devices, ``gloo`` otherwise; the records
always travel through a gloo group (they are Python objects). Multi-node runs use torchrun's own
rendezvous (``--nnodes``, ``--rdzv-backend c10d``, ``--rdzv-endpoint``); the output directory must
then be on a filesystem every node sees.

A process that dies makes the others fail at their next exchange (the connection to it closes) or,
at the latest, after ``ATTNGEOM_DIST_TIMEOUT`` seconds (default 1800); torchrun also stops them
itself (SIGTERM) as soon as it sees a worker die. Either way each survivor ends with one line
(:class:`DistributedError`, exit 2, no traceback): the run stopped, and finished units stay in the
checkpoint, so rerunning the same command, with any number of processes, resumes.

What belongs here: process groups and object exchange. Nothing else.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

from attngeom.errors import AttngeomError, InputError


class DistributedError(AttngeomError):
    """Another process of a multi-process run stopped or could not be reached."""


RESUMES = "the run stopped; rerunning the same command resumes from the records written so far"


def lost_contact(rank: int, detail: str) -> DistributedError:
    """The error of a survivor whose exchange with the other processes failed."""
    return DistributedError(f"rank {rank} lost contact with the other processes (a rank died or was killed: "
                            f"{detail}); {RESUMES}")


def stopped_by_launcher(rank: int) -> DistributedError:
    """The error of a process that the launcher stopped (SIGTERM), as torchrun does to the survivors
    when one of its workers dies."""
    return DistributedError(f"rank {rank} was stopped by the launcher (another rank died or was killed, or "
                            f"the launch was stopped); {RESUMES}")


def world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def local_rank() -> int:
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def local_world_size() -> int:
    """The processes the launcher started on this machine (1 without one)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def local_device() -> str | None:
    """The device this process uses by default: its local GPU under a multi-process launch on a
    CUDA machine, else None (the model's own default)."""
    if world_size() <= 1:
        return None
    import torch

    if torch.cuda.is_available():
        return f"cuda:{local_rank() % torch.cuda.device_count()}"
    return "cpu"


class TorchComm:
    """Exchange between the processes of a ``torch.distributed`` launch (see the module docstring)."""

    def __init__(self, backend: str, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if backend != "gloo" else None
        self._sigterm = self._catch_sigterm()

    def _catch_sigterm(self):
        """Turn the launcher's SIGTERM into :func:`stopped_by_launcher` (one line from the CLI instead
        of a silent death); a second SIGTERM kills at once. Returns the previous handler."""
        rank = self.rank

        def stop(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise stopped_by_launcher(rank)

        try:
            return signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: leave signals alone
            return None

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except DistributedError:
            raise
        except Exception as e:  # gloo/nccl errors: a peer died, a timeout
            raise lost_contact(self.rank, str(e).splitlines()[0][:160] if str(e) else type(e).__name__) from None

    def barrier(self) -> None:
        self._call(self.dist.barrier, group=self.group)

    def all_gather(self, obj) -> list:
        out = [None] * self.world
        self._call(self.dist.all_gather_object, out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        box = [obj]
        self._call(self.dist.broadcast_object_list, box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self._sigterm is not None:
            try:
                signal.signal(signal.SIGTERM, self._sigterm)
            except ValueError:  # pragma: no cover - not the main thread
                pass
            self._sigterm = None
        if self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception:  # pragma: no cover - teardown after a failure
                pass


def comm_from_env(device: str | None = None):
    """:class:`TorchComm` under a multi-process launch (``WORLD_SIZE > 1``), else the one-process
    :class:`~attngeom.runs.run.SingleProcess`. ``device``: the ``--device`` given, to choose the backend
    (``nccl`` needs CUDA: asking for it without a GPU is an :class:`InputError`)."""
    from attngeom.runs.run import SingleProcess

    if world_size() <= 1:
        return SingleProcess()
    import torch

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        if var not in os.environ:
            raise InputError(f"WORLD_SIZE is {world_size()} but {var} is not set: launch with torchrun "
                             "(or accelerate launch), which sets them")
    wants_cuda = (device or local_device() or "cpu").startswith("cuda")
    backend = os.environ.get("ATTNGEOM_DIST_BACKEND") or ("nccl" if wants_cuda else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InputError("the nccl backend needs CUDA GPUs and none is available; run on CPU (gloo) or on a GPU machine")
    if backend not in ("gloo", "nccl"):
        raise InputError(f"ATTNGEOM_DIST_BACKEND must be gloo or nccl, got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    timeout = float(os.environ.get("ATTNGEOM_DIST_TIMEOUT", "1800"))
    try:
        return TorchComm(backend, timeout)
    except DistributedError:
        raise
    except Exception as e:
        raise DistributedError(f"could not join the process group ({str(e).splitlines()[0][:200]})") from None
