"""Writing an output so that a fault costs one line, not a traceback (issue 37).

Every file a command writes (HDF5, figure, text) goes through :func:`atomic_file`: it is
written under a temporary name beside the target (``.NAME.XXXXXXXX.tmp.SUFFIX``), fsynced,
given the mode an ordinary ``open`` would and moved into place with ``os.replace``. On any
error the temporary file is removed, so an earlier file at the target stays byte-identical,
and an OS error (no space ENOSPC, permission EACCES, read-only filesystem EROFS, quota EDQUOT,
I/O error EIO, …) becomes one :class:`WriteFault`: ``cannot write results/x.h5: No space left
on device (ENOSPC)``, which ``loradyn`` prints as its one error line.

HDF5 files (:func:`hdf5_writer`) reach the disk through :class:`GuardedFile`, h5py's
``fileobj`` driver over ``os.pwrite``, so that the HDF5 library never sees a failed write:
with HDF5 2.0 one leaves h5py objects whose deallocation prints a hundred lines of
``Exception ignored in: 'h5py._objects.ObjectID.__dealloc__'`` and then crashes the
interpreter. The first error is kept, what the library writes after it is held in memory so
that it finishes and closes normally, and the error is raised once the file is closed.
"""

from __future__ import annotations

import errno as _errno
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = ["WriteFault", "fault", "atomic_file", "hdf5_writer", "GuardedFile", "file_mode"]


class WriteFault(OSError):
    """An output that could not be written: one line naming the path and the cause."""

    def __str__(self) -> str:
        return str(self.strerror)


def fault(path, exc: OSError) -> WriteFault:
    """``exc`` as a :class:`WriteFault` about ``path`` (returned unchanged if it is one)."""
    if isinstance(exc, WriteFault):
        return exc
    code = _errno.errorcode.get(exc.errno or 0)
    cause = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    return WriteFault(exc.errno, f"cannot write {path}: {cause}" + (f" ({code})" if code
                                                                     else ""))


def file_mode() -> int:
    """0o666 less the process umask: the mode an ordinary ``open(path, "w")`` would give."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Give ``tmp`` the usual mode, fsync it, move it onto ``final``, fsync the folder."""
    os.chmod(tmp, file_mode())
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(final.parent)


@contextmanager
def atomic_file(final):
    """A temporary path beside ``final``, moved onto it when the block ends without error,
    removed otherwise; OS errors become one :class:`WriteFault` (module docstring)."""
    final = Path(final)
    parent = final.parent if str(final.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=parent, prefix=f".{final.name}.",
                                    suffix=f".tmp{final.suffix}")
        os.close(fd)
    except OSError as exc:
        raise fault(final, exc) from None
    tmp = Path(name)
    try:
        yield tmp
        _commit(tmp, final)
    except BaseException as exc:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise fault(final, exc) from None
        raise


@contextmanager
def hdf5_writer(final, *, update: bool = False):
    """An ``h5py.File`` written atomically to ``final`` through a :class:`GuardedFile`
    (module docstring); ``update``: start from a copy of the existing ``final`` (mode r+)."""
    import h5py

    with atomic_file(final) as tmp:
        if update:
            shutil.copyfile(final, tmp)
        sink = GuardedFile(tmp, create=not update)
        try:
            with h5py.File(sink, "r+" if update else "w") as f:
                yield f
        finally:
            sink.close()
        if sink.error is not None:
            raise sink.error


class GuardedFile:
    """A read-write file object for h5py's ``fileobj`` driver whose writes never fail: the
    first OSError is kept in ``error`` and every later write is held in memory (``spill``)
    instead, reads seeing it, so the HDF5 library finishes; the caller raises ``error``."""

    def __init__(self, path, create: bool = True):
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        self.fd = os.open(path, flags, 0o600)
        self.pos = 0
        self.size = os.fstat(self.fd).st_size
        self.error: OSError | None = None
        self.spill: list[tuple[int, bytes]] = []  # (offset, data) after the error, in order

    def _guard(self, call, *args) -> None:
        if self.error is None:
            try:
                call(*args)
            except OSError as exc:
                self.error = exc

    def _pwrite(self, data: bytes, at: int) -> None:
        view = memoryview(data)
        while view:
            done = os.pwrite(self.fd, view, at)
            view, at = view[done:], at + done

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = pos + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        data = bytes(data)
        self._guard(self._pwrite, data, self.pos)
        if self.error is not None:
            self.spill.append((self.pos, data))
        self.pos += len(data)
        self.size = max(self.size, self.pos)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        size = max(min(self.size - self.pos, size if size >= 0 else self.size), 0)
        buf = bytearray(size)
        try:
            head = os.pread(self.fd, size, self.pos)
            buf[: len(head)] = head
        except OSError as exc:
            self.error = self.error or exc
        for at, data in self.spill:  # later writes win
            lo, hi = max(at, self.pos), min(at + len(data), self.pos + size)
            if lo < hi:
                buf[lo - self.pos: hi - self.pos] = data[lo - at: hi - at]
        self.pos += size
        return bytes(buf)

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        self._guard(os.ftruncate, self.fd, size)
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing to flush: every write went to the kernel (or to ``spill``)."""

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
