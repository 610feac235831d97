"""``kill -9`` at random moments never corrupts finished cells; a resume completes the sweep
with numbers identical to an uninterrupted run (the batch plan depends on the file only)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import sweep_toml

from sims.experiments.sweep import run_sweep
from sims.experiments.sweep_spec import load_sweep
from sims.io.sweep import cell_dir, finished_cells, read_sweep
from sims.io.trajectory import read_trajectory

SPEC = sweep_toml(axes={"xi": [0.5, 1.0, 2.0], "joint_c": [False, True], "instance_seed": [1, 2]},
                  instance={"d": 30}, steps_per_d=60, checkpoints=40, engine="full")
MAIN = "import sys; from sims.cli import main; sys.argv[0] = 'loradyn'; main()"


def _arrays(traj):
    return [traj.overlap, traj.loss, traj.ode, traj.diverged_step, traj.xi]


def _check_against(reference: dict, out) -> int:
    """Every finished cell file and the combined file read back equal to the reference."""
    done = finished_cells(out)
    for digest, path in done.items():
        traj, _ = read_trajectory(path)
        for got, want in zip(_arrays(traj), reference[digest], strict=True):
            np.testing.assert_array_equal(got, want)
    if out.exists():
        _, cells = read_sweep(out)
        for cell in cells:
            for got, want in zip(_arrays(cell.traj), reference[cell.meta["hash"]],
                                 strict=True):
                np.testing.assert_array_equal(got, want)
    return len(done)


@pytest.mark.slow
def test_sigkill_at_random_times_then_resume(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC)
    spec = load_sweep(tmp_path / "s.toml")
    ref_out = tmp_path / "ref" / "o.h5"
    run_sweep(spec, ref_out, batch=False)
    reference = {}
    for digest, path in finished_cells(ref_out).items():
        reference[digest] = _arrays(read_trajectory(path)[0])
    assert len(reference) == 12

    out = tmp_path / "run" / "o.h5"
    cmd = [sys.executable, "-c", MAIN, "sweep", str(tmp_path / "s.toml"), "--out", str(out),
           "--no-batch"]
    rng = random.Random(1234)
    counts = []
    for target in (2, 8):  # kill once at least `target` cells are done, + a random delay
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=tmp_path)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if len(list(cell_dir(out).glob("[!.]*.h5"))) >= target:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        counts.append(_check_against(reference, out))
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] < 12, counts
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "computed" in done.stdout
    assert _check_against(reference, out) == 12
    _, cells = read_sweep(out)
    assert len(cells) == 12
    assert not [p for p in cell_dir(out).iterdir() if p.name.endswith(".partial.h5")]
