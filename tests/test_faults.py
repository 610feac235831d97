"""Issue 37: a fault while writing is one line, and one writer per output.

OS errors (ENOSPC, EACCES, EROFS, EDQUOT, EIO) injected into the HDF5 writes, the figure
writes and the final fsync, and real ENOSPC on a tiny tmpfs (skipped where mounting is not
permitted): one line on stderr naming the file and the cause, exit 1, no traceback, no crash,
no temporary or lock file left, an earlier file byte-identical; sweeps keep their finished
cells. The output lock: a second writer is refused at start naming the holder's pid, a stale
lock is taken over, the lock goes at exit (also on error and Ctrl-C).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner
from helpers import TINY_SPEC_TOML, sweep_toml

from sims.cli import cli
from sims.io import atomic
from sims.io.lock import lock_path, output_lock
from sims.io.sweep import cell_dir, finished_cells
from sims.io.trajectory import read_trajectory

RUN = ["--eta", "0.002", "--steps", "50", "--runs", "4", "--checkpoints", "20"]
SWEEP = sweep_toml(axes={"xi": [0.5, 1.0, 2.0]}, steps_per_d=2, checkpoints=10,
                   engine="full")
CODES = ["ENOSPC", "EACCES", "EROFS", "EDQUOT", "EIO"]
MAIN = "import sys; from sims.cli import main; sys.argv[0] = 'loradyn'; main()"


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.toml").write_text(TINY_SPEC_TOML)
    (tmp_path / "s.toml").write_text(SWEEP)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def oserror(name: str) -> OSError:
    code = getattr(errno, name)
    return OSError(code, os.strerror(code))


def one_error_line(res, path, name: str) -> None:
    """Exit 1 through click (no exception escaped), stderr one line naming path and cause."""
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"Error: cannot write {path}: ")
    assert lines[0].endswith(f"{os.strerror(getattr(errno, name))} ({name})")
    assert "Traceback" not in res.output


def leftovers(folder) -> list[str]:
    """Temporary and lock files anywhere under ``folder``."""
    return sorted(p.name for p in Path(folder).rglob(".*") if p.name.endswith(
        (".lock", ".tmp.h5", ".tmp.png", ".partial.h5")))


def fail_on(monkeypatch, owner, attr: str, name: str, when=lambda *a: True) -> None:
    """Make ``owner.attr`` raise the OS error ``name`` on the calls where ``when(*args)``."""
    real = getattr(owner, attr)

    def flaky(*args, **kw):
        if when(*args):
            raise oserror(name)
        return real(*args, **kw)

    monkeypatch.setattr(owner, attr, flaky)


def from_call(n: int, match=lambda *a: True):
    """A ``when`` that holds from the n-th call that ``match``es on."""
    seen = []

    def when(*args):
        if match(*args):
            seen.append(args)
            return len(seen) >= n
        return False

    return when


def cell_file(tmp, final) -> bool:
    return Path(final).parent.name.endswith(".cells")


# ---------------------------------------------------------------- injected faults
@pytest.mark.parametrize("name", CODES)
def test_run_write_fault_is_one_line_and_keeps_the_earlier_file(here, monkeypatch, name):
    """A failed write inside HDF5 (the old traceback storm and segfault)."""
    assert invoke("run", "spec.toml", *RUN, "--out", "out.h5").exit_code == 0
    before = digest("out.h5")
    fail_on(monkeypatch, atomic.GuardedFile, "_pwrite", name, from_call(4))
    res = invoke("run", "spec.toml", *RUN, "--seed", "1", "--out", "out.h5", "--force")
    one_error_line(res, "out.h5", name)
    assert digest("out.h5") == before and leftovers(here) == []
    assert sorted(os.listdir(here)) == ["out.h5", "s.toml", "spec.toml"]


@pytest.mark.parametrize("name", ["EIO", "EDQUOT"])
def test_a_fault_at_fsync_is_one_line(here, monkeypatch, name):
    """Delayed write errors (NFS, quotas) surface at fsync: the same one line."""
    fail_on(monkeypatch, atomic, "_fsync", name)
    one_error_line(invoke("run", "spec.toml", *RUN, "--out", "new.h5"), "new.h5", name)
    assert not Path("new.h5").exists() and leftovers(here) == []


@pytest.mark.parametrize("name", ["ENOSPC", "EACCES"])
def test_figure_write_fault_is_one_line(here, monkeypatch, name):
    import matplotlib.figure

    assert invoke("run", "spec.toml", *RUN, "--out", "r.h5").exit_code == 0
    assert invoke("plot", "r.h5", "--out", "fig.png").exit_code == 0
    before = digest("fig.png")
    fail_on(monkeypatch, matplotlib.figure.Figure, "savefig", name)
    one_error_line(invoke("plot", "r.h5", "--out", "fig.png", "--force"), "fig.png", name)
    assert digest("fig.png") == before and leftovers(here) == []
    one_error_line(invoke("run", "spec.toml", *RUN, "--out", "r2.h5", "--plot", "r2.png"),
                   "r2.png", name)
    assert not Path("r2.png").exists() and leftovers(here) == []


@pytest.mark.parametrize("name", ["ENOSPC", "EIO"])
def test_sweep_keeps_finished_cells_on_a_fault(here, monkeypatch, name):
    """The second cell's file cannot be written: the first stays, the combined file holds
    it, one line says so and how to resume; the resume computes only what is missing."""
    commit = atomic._commit
    fail_on(monkeypatch, atomic, "_commit", name, from_call(2, cell_file))
    res = invoke("sweep", "s.toml", "--out", "o.h5", "--no-batch")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    line, = res.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot write {cell_dir('o.h5')}/")
    assert f"{os.strerror(getattr(errno, name))} ({name}); 1 of 3 cells kept; resume with: " \
           "loradyn sweep s.toml --out o.h5 --no-batch" in line
    assert len(finished_cells("o.h5")) == 1 and leftovers(here) == []
    with h5py.File("o.h5", "r") as f:
        assert int(f.attrs["n_finished"]) == 1
    monkeypatch.setattr(atomic, "_commit", commit)
    res = invoke("sweep", "s.toml", "--out", "o.h5", "--no-batch")
    assert res.exit_code == 0 and "1 finished, 2 to run" in res.output


def test_a_combined_file_fault_keeps_the_cells(here, monkeypatch):
    """The combined file cannot be rebuilt (quota): the finished cell stays on disk and the
    earlier combined file is byte-identical."""
    fail_on(monkeypatch, atomic, "_commit", "EDQUOT",
            from_call(2, lambda tmp, final: Path(final).name == "o.h5"))
    res = invoke("sweep", "s.toml", "--out", "o.h5", "--no-batch")
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1
    assert "cannot write o.h5: Disk quota exceeded (EDQUOT); 1 of 3 cells kept" in res.stderr
    assert len(finished_cells("o.h5")) == 1 and leftovers(here) == []
    with h5py.File("o.h5", "r") as f:
        assert int(f.attrs["n_finished"]) == 0  # the one written before the fault


def test_guarded_file_keeps_hdf5_whole_after_a_failed_write(tmp_path):
    """After the first failed write (a short one) the library reads back what it wrote,
    from memory, and closes normally; the error is kept for the caller."""
    import numpy as np

    class Full(atomic.GuardedFile):
        def _pwrite(self, data, at):
            room = max(4096 - at, 0)
            super()._pwrite(data[:room], at)
            if len(data) > room:
                raise oserror("ENOSPC")

    sink = Full(tmp_path / "x.h5")
    with h5py.File(sink, "w") as f:
        for i in range(4):
            f.create_dataset(f"d{i}", data=np.arange(5000.0) + i, fletcher32=True)
    assert sink.error is not None and sink.error.errno == errno.ENOSPC and sink.spill
    with h5py.File(sink, "r") as f:  # every byte through GuardedFile.read
        assert [float(f[f"d{i}"][-1]) for i in range(4)] == [4999.0, 5000.0, 5001.0, 5002.0]
    sink.close()


# ---------------------------------------------------------------- free space
def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - free, free))


def test_run_refuses_before_compute_when_the_file_cannot_fit(here, monkeypatch):
    import sims.commands.run as run_mod

    monkeypatch.setattr(run_mod, "simulate", lambda *a, **k: pytest.fail("computed"))
    _free(monkeypatch, 1000)
    res = invoke("run", "spec.toml", *RUN, "--out", "out.h5")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    line, = res.stderr.strip().splitlines()
    assert line.startswith("Error: --out out.h5 needs at least ") and "1000 B free on" in line
    assert not Path("out.h5").exists() and leftovers(here) == []


def test_sweep_refuses_before_compute_when_its_files_cannot_fit(here, monkeypatch):
    _free(monkeypatch, 2000)
    res = invoke("sweep", "s.toml", "--out", "o.h5")
    assert res.exit_code == 1
    line, = res.stderr.strip().splitlines()
    assert line.startswith("Error: --out o.h5 needs at least ") and "free on" in line
    assert not Path("o.h5").exists() and not cell_dir("o.h5").exists()


# ---------------------------------------------------------------- one writer per output
@contextmanager
def held_elsewhere(path, pid: int = 4242):
    """The lock of ``path`` as another process holds it: flocked, stamped ``pid host``."""
    lock = lock_path(path)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{pid} otherhost\n".encode())
    try:
        yield lock
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


@pytest.mark.parametrize("command", [
    ["run", "spec.toml", *RUN, "--out", "x.h5"],
    ["sweep", "s.toml", "--out", "x.h5"],
])
def test_a_second_writer_is_refused_at_start(here, monkeypatch, command):
    import sims.commands.run as run_mod
    import sims.experiments.sweep as sweep_mod

    monkeypatch.setattr(run_mod, "simulate", lambda *a, **k: pytest.fail("computed"))
    monkeypatch.setattr(sweep_mod, "plan_batches", lambda *a, **k: pytest.fail("computed"))
    with held_elsewhere("x.h5") as lock:
        res = invoke(*command)
        assert lock.read_text() == "4242 otherhost\n"  # the holder's lock untouched
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    line, = res.stderr.strip().splitlines()
    assert line == ("Error: --out x.h5 is being written by another loradyn process (pid 4242 "
                    "on otherhost); wait for it to finish or choose another path")
    assert not Path("x.h5").exists()


def test_plot_output_is_locked_too(here):
    assert invoke("run", "spec.toml", *RUN, "--out", "r.h5").exit_code == 0
    with held_elsewhere("fig.png"):
        res = invoke("plot", "r.h5", "--out", "fig.png")
    assert res.exit_code == 1 and "(pid 4242 on otherhost)" in res.stderr
    assert not Path("fig.png").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_is_taken_over_and_removed(here):
    lock = lock_path("x.h5")
    lock.write_text(f"{_dead_pid()} {os.uname().nodename}\n")  # a killed writer's file
    res = invoke("run", "spec.toml", *RUN, "--out", "x.h5")
    assert res.exit_code == 0, res.output
    assert read_trajectory("x.h5")[1]["complete"] and not lock.exists()


def test_the_lock_goes_on_error_and_on_ctrl_c(here, monkeypatch):
    import sims.commands.run as run_mod

    def interrupted(*a, **k):
        assert lock_path("x.h5").read_text().split()[0] == str(os.getpid())
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "simulate", interrupted)
    res = invoke("run", "spec.toml", *RUN, "--out", "x.h5")
    assert res.exit_code == 1 and "Aborted" in res.output
    assert leftovers(here) == [] and not Path("x.h5").exists()
    res = invoke("run", "nope.toml", *RUN, "--out", "sub/x.h5")  # an error after the lock
    assert res.exit_code == 1 and leftovers(here) == [] and not Path("sub").exists()


def _loradyn(*args, **kw):
    return subprocess.Popen([sys.executable, "-c", MAIN, *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_a_writer_in_another_process_is_named(here):
    """The lock held by this process (output_lock): `loradyn run` in another one is refused
    at start naming this pid; once released, the same command writes the file."""
    with output_lock("cc.h5"):
        out, err = _loradyn("run", "spec.toml", *RUN, "--out", "cc.h5").communicate()
        assert f"(pid {os.getpid()} on " in err and len(err.strip().splitlines()) == 1
    assert not Path("cc.h5").exists() and not lock_path("cc.h5").exists()
    proc = _loradyn("run", "spec.toml", *RUN, "--out", "cc.h5")
    out, err = proc.communicate()
    assert proc.returncode == 0 and "wrote cc.h5" in out, err


def test_two_writers_started_together_one_wins(here):
    """Started together, exactly one writes cc.h5; the other exits 1 with one line (the
    holder named, or the file it wrote refused without --force): no result is lost
    silently."""
    procs = [_loradyn("run", "spec.toml", *RUN, "--seed", str(s), "--out", "cc.h5")
             for s in (1, 2)]
    results = {}
    for proc in procs:
        out, err = proc.communicate()
        results.setdefault(proc.returncode, []).append((out, err))
    assert sorted(results) == [0, 1] and len(results[0]) == 1, results
    (out, _), = results[0]
    (_, err), = results[1]
    assert "wrote cc.h5" in out and len(err.strip().splitlines()) == 1
    assert "being written by another loradyn process (pid " in err or "exists" in err
    assert read_trajectory("cc.h5")[1]["complete"] and leftovers(here) == []


# ---------------------------------------------------------------- a real full filesystem
@pytest.fixture
def tiny_fs(tmp_path):
    """A 300 KiB tmpfs in tmp_path (skipped where mounting is not permitted), unmounted."""
    where = tmp_path / "tiny"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def _fill(folder: Path, leave: int) -> None:
    """Fill ``folder``'s filesystem to ``leave`` bytes free."""
    free = shutil.disk_usage(folder).free
    (folder / "filler").write_bytes(b"\0" * max(free - leave, 0))


def _cli(*args, cwd):
    done = subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], cwd=cwd, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 1, (done.returncode, done.stderr)  # 139: the old segfault
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    return done.stderr.strip()


def test_no_space_left_is_one_line_not_a_crash(here, tiny_fs):
    """Real ENOSPC inside the HDF5 writes: one line, exit 1 (it was 111 lines of h5py
    tracebacks and a segfault), the earlier file byte-identical, nothing else left."""
    out = tiny_fs / "x.h5"
    assert invoke("run", "spec.toml", *RUN, "--out", out).exit_code == 0
    before = digest(out)
    _fill(tiny_fs, 24_000)
    line = _cli("run", "spec.toml", *RUN, "--seed", "1", "--out", out, "--force", cwd=here)
    assert line == f"Error: cannot write {out}: No space left on device (ENOSPC)"
    assert digest(out) == before and sorted(os.listdir(tiny_fs)) == ["filler", "x.h5"]


def test_a_read_only_filesystem_is_one_line(here, tiny_fs):
    out = tiny_fs / "x.h5"
    assert invoke("run", "spec.toml", *RUN, "--out", out).exit_code == 0
    before = digest(out)
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    res = invoke("run", "spec.toml", *RUN, "--out", out, "--force")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert res.stderr == f"Error: --out {out}: cannot write, directory {tiny_fs} is not " \
                         "writable\n"
    assert digest(out) == before and os.listdir(tiny_fs) == ["x.h5"]


def test_a_sweep_on_a_full_disk_keeps_its_cells(here, tiny_fs):
    """A sweep that fills the disk stops with one line; its finished cells stay, and once
    there is room the resume completes it with the numbers of an uninterrupted sweep."""
    out = tiny_fs / "o.h5"
    _fill(tiny_fs, 120_000)
    line = _cli("sweep", "s.toml", "--out", out, "--no-batch", cwd=here)
    assert "No space left on device (ENOSPC)" in line and "cells kept; resume with" in line
    kept = finished_cells(out)
    assert 1 <= len(kept) < 3 and leftovers(tiny_fs) == []
    for path in kept.values():
        assert read_trajectory(path)[1]["complete"]
    (tiny_fs / "filler").unlink()
    res = invoke("sweep", "s.toml", "--out", out, "--no-batch")
    assert res.exit_code == 0 and f"{len(kept)} finished" in res.output
    assert invoke("sweep", "s.toml", "--out", "ref.h5", "--no-batch").exit_code == 0
    for digest_, path in finished_cells("ref.h5").items():
        ref, got = read_trajectory(path)[0], read_trajectory(finished_cells(out)[digest_])[0]
        assert (ref.overlap == got.overlap).all()
