"""Interrupted runs keep their work (issue 26): SIGINT/SIGTERM on `loradyn run` writes the
checkpoints reached as a complete trajectory file marked ``interrupted`` (and the run's state
to its resume file, issue 37.3) and exits 130/143; the reduced engine stops at its next
segment end (issue 38.2); an interrupted sweep keeps its finished cells and prints the
command that resumes it.

The subprocess tests send real signals at a known point through the engine's test hook
(``LORADYN_TEST_INTERRUPT_AFTER_CHUNKS``, :mod:`dynamics.engines.engine`), so they do not depend on
the machine's load; one sweep test signals from outside once a cell file exists.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import sweep_toml

from dynamics.engines.engine import (
    TEST_INTERRUPT_ENV,
    FullRun,
    Interrupted,
    interruptible,
)
from dynamics.runtime.trajectory import checkpoint_steps
from dynamics.setup.config import RunConfig
from sims.cli import cli
from sims.commands.sweep import resume_command
from sims.io.sweep import cell_dir, finished_cells, read_sweep
from sims.io.trajectory import read_trajectory

MAIN = "import sys; from sims.cli import main; sys.argv[0] = 'loradyn'; main()"
SPEC = 'activation = "relu"\nk = 3\nd = 20\nxi = 1.0\nseed = 9\n'
STEPS = 20000
RUN = ["--runs", "3", "--eta", "0.002", "--steps", str(STEPS), "--checkpoints", "20",
       "--spacing", "linear", "--engine", "full"]
SWEEP = sweep_toml(axes={"xi": [0.5, 1.0, 2.0], "joint_c": [False, True]},
                   instance={"d": 30}, steps_per_d=10, checkpoints=5, spacing="linear",
                   engine="full")  # the full engine: its chunk hook interrupts the sweep


def _loradyn(tmp_path, *args, chunks=None, sig="INT", timeout=300):
    env = dict(os.environ)
    env.pop(TEST_INTERRUPT_ENV, None)
    if chunks is not None:
        env[TEST_INTERRUPT_ENV] = str(chunks)
        env["LORADYN_TEST_INTERRUPT_SIGNAL"] = sig
    return subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=timeout)


def _show(path) -> str:
    res = CliRunner().invoke(cli, ["show", str(path)])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize(("sig", "code"), [("INT", 130), ("TERM", 143)])
def test_interrupted_run_writes_the_checkpoints_reached(tmp_path, sig, code):
    (tmp_path / "spec.toml").write_text(SPEC)
    res = _loradyn(tmp_path, "run", "spec.toml", *RUN, "--out", "part.h5", "--plot", "p.png",
                   chunks=7, sig=sig)
    assert res.returncode == code, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    found = re.fullmatch(rf"interrupted \(SIG{sig}\) at step (\d+) of {STEPS}: checkpoints up "
                         r"to step (\d+) written to part\.h5, marked interrupted; --plot "
                         r"skipped; the same command with --resume continues it "
                         r"\(part\.h5\.resume\)", lines[0])
    assert found, lines[0]
    at, last = int(found[1]), int(found[2])
    assert not (tmp_path / "p.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.h5", "part.h5.resume",
                                                          "spec.toml"]

    traj, meta = read_trajectory(tmp_path / "part.h5")  # complete, checksummed
    assert meta["interrupted"] is True and meta["interrupted_at_step"] == at
    assert meta["interrupted_by"] == f"SIG{sig}" and meta["config"]["steps"] == STEPS
    planned = checkpoint_steps(STEPS, 20, "linear")
    n = traj.steps.size
    assert 2 <= n < planned.size
    np.testing.assert_array_equal(traj.steps, planned[:n])
    assert traj.steps[-1] == last <= at < planned[n]
    for curve in (traj.overlap, traj.loss, traj.ode):
        assert curve.shape == (3, n) and np.isfinite(curve).all()
    assert traj.ode_corrected.shape == (3, n)

    shown = _show(tmp_path / "part.h5")
    assert re.search(rf"^interrupted +at step {at} of {STEPS} \(checkpoints up to step "
                     rf"{last}; SIG{sig}\)$", shown, re.M), shown
    info = CliRunner().invoke(cli, ["show", str(tmp_path / "part.h5"), "--json"]).output
    assert f'"at_step": {at}' in info


def test_interrupted_run_never_replaces_a_file_without_force(tmp_path):
    (tmp_path / "spec.toml").write_text(SPEC)
    (tmp_path / "keep.h5").write_bytes(b"precious")
    res = _loradyn(tmp_path, "run", "spec.toml", *RUN, "--out", "keep.h5", chunks=2)
    assert res.returncode == 1 and "--force" in res.stderr  # refused before any compute
    assert (tmp_path / "keep.h5").read_bytes() == b"precious"


def _compile_reduced_kernel_here():
    """Run the reduced engine once in this process, on the instance and settings of the CLI run
    below but 20 steps (no finite-d theory): numba compiles the chain's kernels here (or loads
    them, ~1 s) and writes their on-disk cache, so the subprocess loads them instead of
    compiling them cold (~45 s of CPU after any edit of dynamics/reduced/, which drops that
    cache; the worker compiles them for its other reduced-engine tests anyway)."""
    from dynamics.engines.engine import simulate

    instance = {"activation": "relu", "k": 3, "d": 20, "xi": 1.0, "seed": 9}
    simulate(RunConfig(instance=instance, engine="reduced", runs=3, eta=0.002, steps=20,
                       checkpoints=20, spacing="linear", finite_d_theory=False))


def test_reduced_engine_stops_at_a_segment_end(tmp_path, monkeypatch):
    """The reduced engine advances in segments (issue 38.2): a signal stops it at the next
    segment end, the checkpoints reached written and marked, as the full engine does."""
    _compile_reduced_kernel_here()
    (tmp_path / "spec.toml").write_text(SPEC)
    monkeypatch.setenv("LORADYN_SEGMENT_STEPS", "3000")  # the subprocess inherits it
    res = _loradyn(tmp_path, "run", "spec.toml", *RUN, "--engine", "reduced", "--out",
                   "red.h5", chunks=2, sig="TERM")
    assert res.returncode == 143, res.stderr
    assert res.stderr.strip().splitlines() == [
        "interrupted (SIGTERM) at step 6000 of 20000: checkpoints up to step 5263 written to "
        "red.h5, marked interrupted; the same command with --resume continues it "
        "(red.h5.resume)"]
    traj, meta = read_trajectory(tmp_path / "red.h5")
    assert meta["interrupted"] is True and meta["engine"] == "reduced"
    assert meta["interrupted_at_step"] == 6000
    np.testing.assert_array_equal(traj.steps, checkpoint_steps(STEPS, 20, "linear")[:6])
    assert np.isfinite(traj.overlap).all()
    assert "interrupted      at step 6000 of 20000" in _show(tmp_path / "red.h5")


def test_interrupted_sweep_keeps_cells_and_names_the_resume_command(tmp_path, monkeypatch):
    (tmp_path / "sw.toml").write_text(SWEEP)
    # 300 steps, 5 linear checkpoints: 4 chunks per cell; after 9 chunks 2 cells are written
    res = _loradyn(tmp_path, "sweep", "sw.toml", "--out", "out/sw.h5", "--no-batch",
                   chunks=9)
    assert res.returncode == 130, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("interrupted: 2 of 6 cells written; resume with: loradyn sweep sw.toml "
                    "--out out/sw.h5 --no-batch")
    assert len(finished_cells(tmp_path / "out" / "sw.h5")) == 2
    _, cells = read_sweep(tmp_path / "out" / "sw.h5")  # rebuilt from the finished cells
    assert len(cells) == 2
    monkeypatch.chdir(tmp_path)
    again = shlex.split(last.split("resume with: ", 1)[1])
    assert again[0] == "loradyn"
    done = CliRunner().invoke(cli, again[1:])
    assert done.exit_code == 0, done.output
    assert "computed 4 cell(s), reused 2" in done.output
    assert len(read_sweep(tmp_path / "out" / "sw.h5")[1]) == 6


def test_sweep_interrupted_from_outside(tmp_path):
    """A real Ctrl-C from another process, once a cell is written."""
    (tmp_path / "sw.toml").write_text(SWEEP.replace("steps_per_d = 10", "steps_per_d = 400"))
    out = tmp_path / "sw.h5"
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "sweep", "sw.toml", "--out", "sw.h5",
                             "--no-batch"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items()
                                 if k != TEST_INTERRUPT_ENV})
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if cell_dir(out).is_dir() and list(cell_dir(out).glob("[!.]*.h5")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    found = re.search(r"interrupted: (\d) of 6 cells written; resume with: loradyn sweep "
                      r"sw.toml --out sw.h5 --no-batch$", err.strip())
    assert found, err
    assert 1 <= int(found[1]) < 6 and len(finished_cells(out)) == int(found[1])


def test_resume_command_quotes_and_keeps_options():
    line = resume_command("my spec.toml", Path("r/o.h5"), scheduler="local:2",
                          max_batch_runs=8, update=True)
    assert line == ("loradyn sweep 'my spec.toml' --out r/o.h5 --scheduler local:2 "
                    "--max-batch-runs 8 --update")


# ---------------------------------------------------------------- in-process, no signal sent
def test_full_engine_stops_at_a_chunk_end_when_flagged():
    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 20, "seed": 9},
                       eta=0.002, steps=2000, runs=2, checkpoints=10, spacing="linear")
    with interruptible() as stop:
        stop.signum = signal.SIGINT  # as the handler does on the first signal
        traj = FullRun(config).run()
    assert stop.step is not None and 0 < stop.step < 2000
    assert traj.steps.tolist() == [s for s in checkpoint_steps(2000, 10, "linear")
                                   if s <= stop.step]
    assert traj.overlap.shape == (2, traj.steps.size) and np.isfinite(traj.overlap).all()
    full = FullRun(config).run()  # outside: no flag, the whole horizon
    assert full.steps[-1] == 2000
    np.testing.assert_array_equal(full.overlap[:, :traj.steps.size], traj.overlap)


def test_interruptible_flags_once_then_raises_and_restores_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with interruptible() as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.signal_name == "SIGTERM"
        with pytest.raises(Interrupted) as exc:
            signal.raise_signal(signal.SIGINT)
        assert exc.value.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt), interruptible(keep=False):
        signal.raise_signal(signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_a_callback_swallows_is_raised_again_at_the_next_safe_point():
    """A handler's exception raised inside a weakref callback is only printed by Python
    ("Exception ignored in …"); seen once in a sweep that then finished with status 0.
    ``raise_if_signalled`` (called by the sweep after each batch) raises it again."""
    import gc
    import weakref

    from dynamics.engines.engine import Interrupted, interruptible, raise_if_signalled

    class Thing:
        pass

    continued = False
    with pytest.raises(Interrupted):
        with interruptible(keep=False):
            thing = Thing()
            ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGINT))
            del thing
            gc.collect()
            continued = True
            raise_if_signalled()
    assert continued and ref() is None
    raise_if_signalled()  # cleared when the context exits


def test_a_signal_inside_an_hdf5_write_is_still_a_signal():
    """The handler's Interrupted raised inside h5py's file-object callbacks comes out as a
    SystemError caused by it (seen once when Ctrl-C landed while a sweep file was being
    rebuilt): interrupt_signal finds the signal in the chain, and nothing else."""
    import signal as signals

    from dynamics.engines.engine import Interrupted, interrupt_signal

    def wrapped(signum):
        try:
            try:
                raise Interrupted(signum)
            except Interrupted as inner:
                raise SystemError("returned a result with an exception set") from inner
        except SystemError as outer:
            return outer

    assert interrupt_signal(wrapped(signals.SIGTERM)) == signals.SIGTERM
    assert interrupt_signal(KeyboardInterrupt()) == signals.SIGINT
    assert interrupt_signal(SystemError("unrelated")) is None
    assert interrupt_signal(ValueError("no")) is None
