"""The lock that keeps two processes out of one run directory.

:class:`~attngeom.runs.run.Run` takes ``OUT/.attngeom-lock`` before it looks at the directory and
keeps it until the run ends (under ``torchrun`` only rank 0 takes it). The file holds the holder's
pid, host and start time, and the holder keeps an exclusive ``flock`` on it: the kernel drops that
lock when the process dies, so a lock left by ``kill -9`` is taken over by the next run at once.
Where the filesystem has no ``flock``, the pid is checked instead (a lock of a pid no longer alive
on this host is stale). A second process is refused with one line naming the holder.

Runs of one process share its lock (a second :class:`~attngeom.runs.run.Run` on the same directory in
the same process, as a resume within a test or a notebook does, is not refused).

What belongs here: the lock file. Nothing else.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from attngeom.errors import InputError, OutputError
from attngeom.runs.storage import parse_json

LOCK = ".attngeom-lock"

_held: dict[str, list] = {}
"""Locks this process holds: resolved directory -> [file descriptor, number of holders]."""


def acquire(directory: Path) -> None:
    """Take the lock of ``directory`` (which exists) for this process, or raise
    :class:`~attngeom.errors.InputError` naming the process that holds it."""
    key = str(Path(directory).resolve())
    if key in _held:
        _held[key][1] += 1
        return
    path = Path(key) / LOCK
    for _ in range(20):  # the file may be replaced under us by a holder that releases it
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot create the lock {path}: {e.strerror or e}") from None
        if not _lock_fd(fd, path):
            holder = _holder(path)
            os.close(fd)
            raise InputError(_in_use(directory, holder))
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released and unlinked by its holder between our open and our lock
            os.close(fd)
            continue
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        os.fsync(fd)
        _held[key] = [fd, 1]
        return
    raise OutputError(f"could not take the lock {path}: it is being replaced again and again")


def release(directory: Path) -> None:
    """Give up this process's hold on the lock of ``directory``; the last holder removes the file."""
    key = str(Path(directory).resolve())
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[key]
    fd = entry[0]
    try:
        os.unlink(Path(key) / LOCK)  # unlinked while still locked: a waiting opener sees a new inode
    except OSError:
        pass
    os.close(fd)


def _lock_fd(fd: int, path: Path) -> bool:
    """An exclusive lock on ``fd``: True when taken, False when another live process holds it."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except (ImportError, OSError):  # no flock on this filesystem or platform: judge by the pid
        return not _alive(_read(path))


def _read(path: Path) -> dict:
    try:
        d = parse_json(path.read_bytes() or b"{}")
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


PID_WAIT = 1.0
"""Seconds a refused process waits, at most, for the holder's pid: the holder takes the lock before it
writes its pid, so a process refused in between would not know whom to name."""


def _holder(path: Path) -> dict:
    """The holder named in the lock file ``path``, waiting up to :data:`PID_WAIT` seconds for a holder
    that has taken the lock but not yet written its pid."""
    holder, waited = _read(path), 0.0
    while not isinstance(holder.get("pid"), int) and waited < PID_WAIT:
        time.sleep(0.01)
        waited += 0.01
        holder = _read(path)
    return holder


def _alive(holder: dict) -> bool:
    """Whether the holder named in a lock file is a live process other than this one (a holder on
    another host is taken as alive)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    if holder.get("host") not in (None, socket.gethostname()):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use(directory: Path, holder: dict) -> str:
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since")
    who = f"process {pid}" if pid else "another process"
    if host and host != socket.gethostname():
        who += f" on {host}"
    try:                       # a time the file holds, if it is one (not 1e300, NaN, -1e18 or true)
        when = "" if isinstance(since, bool) or not isinstance(since, (int, float)) else f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
    except (TypeError, ValueError, OverflowError, OSError):
        when = ""
    return (f"{directory} is in use by {who}{when}; wait for it to finish, or use another --out "
            "(nothing was changed)")
