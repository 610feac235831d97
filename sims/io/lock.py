"""One writer per output (issue 37): a lock file beside every output a command writes.

For ``results/x.h5`` the writer holds ``results/.x.h5.lock``: an exclusive ``fcntl.flock``
on a file holding its ``pid host``, for the whole command (from before any compute until its
last write). A second writer is refused at once with one :class:`OutputBusy` line naming the
holder. The kernel drops a flock when its process dies (``kill -9`` included), so a lock file
left behind is stale and the next writer takes it over; the holder removes the file when it
ends (also on an error or a signal). Locks nest within one process: ``loradyn scaling``
holds its sweep file's lock while :func:`sims.experiments.sweep.run_sweep` takes it again.
"""

from __future__ import annotations

import fcntl
import os
import socket
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from sims.io.atomic import fault
from sims.io.outputs import OutputError, check_outputs

__all__ = ["OutputBusy", "lock_path", "output_lock", "claim_outputs", "holder"]

_HELD: dict[str, int] = {}  # lock file (real path) → nesting depth in this process


class OutputBusy(OutputError):
    """An output another process is writing (one line naming its pid and host)."""


def lock_path(path) -> Path:
    """The lock file of the output ``path``: ``.NAME.lock`` in its folder."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"


def holder(lock) -> str:
    """'pid 1234 on host' from a lock file's content ('' if unreadable or empty)."""
    try:
        words = Path(lock).read_text().split()
    except (OSError, UnicodeDecodeError):
        return ""
    return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "") if words else ""


def _same_file(fd: int, lock: Path) -> bool:
    """Whether ``lock`` still names the file open as ``fd`` (not removed by its holder)."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _acquire(lock: Path, path, option: str) -> int:
    """The open, flocked, stamped lock file; OutputBusy if another process holds it."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = holder(lock) or "its pid not yet recorded"
            raise OutputBusy(f"{option} {path} is being written by another loradyn process "
                             f"({who}); wait for it to finish or choose another path"
                             ) from None
        if _same_file(fd, lock):  # else its holder removed it in between: start again
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)  # a stale lock (its process died) is taken over
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError:
        _release(fd, lock)
        raise
    return fd


def _release(fd: int, lock: Path) -> None:
    with suppress(OSError):
        lock.unlink()  # while still held: a waiting writer then finds no file, not ours
    os.close(fd)


def _make_folders(folder: Path, created: list) -> None:
    """Create ``folder`` and its missing parents, each put first in ``created``."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    for item in reversed(missing):
        item.mkdir(exist_ok=True)
        created.insert(0, item)


@contextmanager
def output_lock(path, option: str = "--out"):
    """Hold the lock of the output ``path`` for the block (module docstring); missing
    folders are created for it (and removed after, if still empty). OutputBusy names the
    holder; an OS error is a one-line WriteFault."""
    lock = lock_path(path)
    key = os.path.realpath(lock)
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield lock
        finally:
            _HELD[key] -= 1
        return
    created: list[Path] = []
    try:
        _make_folders(lock.parent, created)
        fd = _acquire(lock, path, option)
    except BaseException as exc:
        _remove(created)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise fault(path, exc) from None
        raise
    _HELD[key] = 1
    try:
        yield lock
    finally:
        del _HELD[key]
        _release(fd, lock)
        _remove(created)


def _remove(folders) -> None:
    """Remove the folders that are still empty, deepest first."""
    for folder in folders:
        with suppress(OSError):
            folder.rmdir()


@contextmanager
def claim_outputs(outputs, inputs=(), *, force: bool = False):
    """:func:`sims.io.outputs.check_outputs`, then hold the lock of every output but an
    ``edit`` one for the block, the outputs checked again under the locks (a writer that
    finished in between is not replaced without ``force``); yields their paths."""
    paths = check_outputs(outputs, inputs, force=force)
    with ExitStack() as stack:
        for out, path in zip(outputs, paths, strict=True):
            if path is not None and out.policy != "edit":
                stack.enter_context(output_lock(path, out.option))
        yield check_outputs(outputs, inputs, force=force)
