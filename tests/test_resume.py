"""Long runs survive a kill (issue 37.3): `loradyn run` keeps a resume file beside --out
(``OUT.resume``, :mod:`sims.io.resume`), and the same command plus ``--resume`` ends with the
very numbers of an uninterrupted run — every dataset of the file, theory lines included — on
the full engine (per-run, shared and counter streams, diverged runs) and on every exact chain
(rank-1 on numba and torch, glm, rank-r, the network chain with a committee teacher and its
diffusion, wide rows, diverged runs, the linearized chain).

The runs are killed with SIGKILL at a known chunk or segment through the engine's test hook
(``LORADYN_TEST_INTERRUPT_AFTER_CHUNKS``, ``LORADYN_TEST_INTERRUPT_SIGNAL=KILL``), the resume
file saved at every chunk or segment end (``LORADYN_RESUME_SECONDS=0``), so nothing depends
on the machine's speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.engines.engine import (
    TEST_INTERRUPT_ENV,
    FullRun,
    iter_chunk_schedule,
    simulate,
    start,
)
from dynamics.runtime.resume import Checkpointer, ResumeError
from dynamics.runtime.trajectory import checkpoint_steps
from dynamics.setup.config import RunConfig
from sims.cli import cli
from sims.io.resume import is_resume_file, read_resume, resume_path

MAIN = "import sys; from sims.cli import main; sys.argv[0] = 'loradyn'; main()"
FINETUNE = 'activation = "relu"\nk = 3\nd = 40\nxi = 1.0\nseed = 9\n'
SMALL_K2 = 'activation = "relu"\nk = 2\nd = 40\nxi = 1.0\nseed = 3\n'
COMMITTEE = 'activation = "erf"\nk = 2\nd = 50\nteacher = "committee"\nseed = 3\n'
QUIET = ["--no-finite-d-theory"]

# name → (spec, arguments, chunks or segments before the kill, segment steps (reduced))
CASES = {
    "full-finetune-joint-noise": (FINETUNE, ["--engine", "full", "--runs", "3", "--steps",
                                             "5000", "--eta", "0.002", "--joint-c",
                                             "--label-noise", "0.05", "--checkpoints", "12"],
                                  7, None),
    "full-counter-streams": (FINETUNE, ["--engine", "full", "--runs", "3", "--steps", "4000",
                                        "--eta", "0.002", "--streams", "counter",
                                        "--checkpoints", "10", *QUIET], 6, None),
    "full-shared-stream": (FINETUNE, ["--engine", "full", "--runs", "3", "--steps", "4000",
                                      "--eta", "0.002", "--streams", "shared", "--batch", "2",
                                      "--checkpoints", "10", *QUIET], 6, None),
    "full-lora": (FINETUNE, ["--engine", "full", "--learner", "lora", "--rank", "2",
                             "--runs", "3", "--steps", "3000", "--eta", "0.002",
                             "--checkpoints", "10", *QUIET], 5, None),
    "full-diverging": (SMALL_K2, ["--engine", "full", "--learner", "scratch", "--rows",
                                  "free", "--runs", "4", "--steps", "2000", "--eta", "0.6",
                                  "--checkpoints", "10", "--spacing", "linear", *QUIET], 5,
                       None),
    "rank-1": (FINETUNE, ["--engine", "reduced", "--runs", "4", "--steps", "6000", "--eta",
                          "0.002", "--joint-c", "--no-project", "--batch", "2",
                          "--label-noise", "0.1", "--checkpoints", "12", *QUIET], 3, 1700),
    "rank-1-torch": (FINETUNE, ["--engine", "reduced", "--set", "activation=erf(x/sqrt2)",
                                "--runs", "3", "--steps", "600", "--eta", "0.002",
                                "--checkpoints", "8", *QUIET], 2, 230),
    "glm": ('activation = "he3"\nk = 1\nd = 60\nxi = 1.0\nseed = 2\n',
            ["--engine", "reduced", "--learner", "glm", "--runs", "4", "--steps", "5000",
             "--eta", "0.01", "--checkpoints", "10", *QUIET], 3, 1300),
    "rank-r": ('activation = "relu"\nk = 4\nd = 60\nxi = 1.0\nseed = 2\n',
               ["--engine", "reduced", "--learner", "lora", "--rank", "2", "--joint-c",
                "--runs", "3", "--steps", "3000", "--eta", "0.01", "--checkpoints", "10",
                *QUIET], 2, 1100),
    "committee-diffusion": (COMMITTEE, ["--engine", "reduced", "--learner", "scratch",
                                        "--runs", "3", "--steps", "800", "--eta", "0.004",
                                        "--checkpoints", "10"], 3, 190),
    "network-wide": ('activation = "relu"\nk = 2\nd = 200\nxi = 1.0\nseed = 3\n',
                     ["--engine", "reduced", "--learner", "scratch", "--width", "32",
                      "--runs", "3", "--steps", "300", "--eta", "0.002", "--checkpoints", "6",
                      *QUIET], 2, 97),
    "network-diverging": (SMALL_K2, ["--engine", "reduced", "--learner", "scratch", "--rows",
                                     "free", "--runs", "6", "--steps", "2000", "--eta", "0.6",
                                     "--checkpoints", "10", *QUIET], 3, 450),
    "linearized": (FINETUNE, ["--engine", "reduced", "--learner", "linearized", "--full-rank",
                              "--batch", "2", "--runs", "3", "--steps", "1500", "--eta",
                              "0.02", "--checkpoints", "8", *QUIET], 2, 400),
}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORADYN_TEST_", "LORADYN_SEGMENT", "LORADYN_RESUME"))}
    return env | {k: str(v) for k, v in extra.items()}


def _killed(tmp_path, args, chunks, segment) -> subprocess.CompletedProcess:
    """`loradyn run ARGS` killed with SIGKILL after ``chunks`` chunks/segments, saving its
    state at every one."""
    env = _env(LORADYN_RESUME_SECONDS=0, LORADYN_TEST_INTERRUPT_AFTER_CHUNKS=chunks,
               LORADYN_TEST_INTERRUPT_SIGNAL="KILL",
               **({"LORADYN_SEGMENT_STEPS": segment} if segment else {}))
    return subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)


def _invoke(args, monkeypatch, tmp_path, **env):
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("LORADYN_TEST_", "LORADYN_SEGMENT",
                                                       "LORADYN_RESUME"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    return CliRunner().invoke(cli, args)


def _datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset)
                     else None)
    return out


def _assert_same_files(a, b) -> None:
    da, db = _datasets(a), _datasets(b)
    assert sorted(da) == sorted(db)
    for name, value in da.items():
        assert np.array_equal(value, db[name], equal_nan=value.dtype.kind == "f"), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the diverging runs' theory overflows
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "committee-diffusion" else n for n in CASES])
def test_a_killed_run_resumes_to_the_numbers_of_an_uninterrupted_one(name, tmp_path,
                                                                      monkeypatch):
    spec, args, chunks, segment = CASES[name]
    (tmp_path / "spec.toml").write_text(spec)
    run = ["run", "spec.toml", *args]
    # every run of the diverging cases diverges (at about step 450): exit 1, file written
    ok = 1 if "diverging" in name else 0
    whole = _invoke([*run, "--out", "whole.h5"], monkeypatch, tmp_path)  # compiles here too
    assert whole.exit_code == ok, whole.output
    assert not resume_path(tmp_path / "whole.h5").exists()

    killed = _killed(tmp_path, [*run, "--out", "part.h5"], chunks, segment)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = resume_path(tmp_path / "part.h5")
    assert saved.exists() and not (tmp_path / "part.h5").exists()
    state, meta = read_resume(saved)
    assert 0 < state.step < state.total and json.loads(meta["config"])["runs"] == state.runs
    shown = _invoke(["show", "part.h5"], monkeypatch, tmp_path)
    assert shown.exit_code == 0, shown.output
    assert re.search(rf"^unfinished +step {state.step} of {state.total} ", shown.output, re.M)

    resumed = _invoke([*run, "--out", "part.h5", "--resume"], monkeypatch, tmp_path)
    assert resumed.exit_code == ok, resumed.output
    assert f"resumed at step {state.step} from part.h5.resume" in resumed.output
    assert not saved.exists()  # a finished run removes its resume file
    _assert_same_files(tmp_path / "whole.h5", tmp_path / "part.h5")
    if name == "committee-diffusion":
        with h5py.File(tmp_path / "part.h5") as f:
            assert f["extra/ode_loss"].attrs["integrator"] == "diffusion"
    if "diverging" in name:
        with h5py.File(tmp_path / "part.h5") as f:
            div = f["diverged_step"][()]
        assert (div >= 0).all() and (div < state.step).any()  # frozen before the kill


def test_a_signal_leaves_a_resume_file_and_resume_finishes_the_run(tmp_path, monkeypatch):
    """SIGINT on the full engine: the checkpoints reached are written (marked interrupted),
    the state at the stop too; --resume replaces the interrupted file with the whole run."""
    spec, args, _, _ = CASES["full-counter-streams"]
    (tmp_path / "spec.toml").write_text(spec)
    run = ["run", "spec.toml", *args]
    assert _invoke([*run, "--out", "whole.h5"], monkeypatch, tmp_path).exit_code == 0
    res = subprocess.run([sys.executable, "-c", MAIN, *run, "--out", "part.h5"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env=_env(**{TEST_INTERRUPT_ENV: 4}))
    assert res.returncode == 130, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.endswith("marked interrupted; the same command with --resume continues it "
                         "(part.h5.resume)"), line
    state, _ = read_resume(tmp_path / "part.h5.resume")
    assert f"interrupted (SIGINT) at step {state.step} of 4000" in line
    shown = _invoke(["show", "part.h5"], monkeypatch, tmp_path).output
    assert re.search(rf"^resume file +part\.h5\.resume: step {state.step} of 4000", shown,
                     re.M), shown
    again = _invoke([*run, "--out", "part.h5"], monkeypatch, tmp_path)
    assert again.exit_code == 1 and "--force" in again.output  # the interrupted file stays
    resumed = _invoke([*run, "--out", "part.h5", "--resume"], monkeypatch, tmp_path)
    assert resumed.exit_code == 0, resumed.output
    _assert_same_files(tmp_path / "whole.h5", tmp_path / "part.h5")
    assert not (tmp_path / "part.h5.resume").exists()


def _killed_reduced(tmp_path, extra=()):
    (tmp_path / "spec.toml").write_text(FINETUNE)
    args = ["run", "spec.toml", "--engine", "reduced", "--runs", "2", "--steps", "3000",
            "--eta", "0.002", "--checkpoints", "8", *QUIET, *extra, "--out", "o.h5"]
    simulate(RunConfig(instance={"activation": "relu", "k": 3, "d": 40, "xi": 1.0,
                                 "seed": 9}, engine="reduced", runs=2, eta=0.002, steps=10,
                       finite_d_theory=False))  # the kernel compiled (cached) here
    res = _killed(tmp_path, args, 2, 700)
    assert res.returncode == -signal.SIGKILL, res.stderr
    return args


def test_resume_refuses_another_command_and_changes_nothing(tmp_path, monkeypatch):
    args = _killed_reduced(tmp_path)
    saved = tmp_path / "o.h5.resume"
    before = saved.read_bytes()
    for change, words in ((["--eta", "0.003"], "config differs (eta 0.002 ≠ 0.003"),
                          (["--set", "d=41"], "config differs (instance.d 40 ≠ 41"),
                          (["--runs", "3"], "config differs (runs 2 ≠ 3"),
                          (["--engine", "full"], "config differs (engine")):
        res = _invoke([*args, *change, "--resume"], monkeypatch, tmp_path)
        assert res.exit_code == 1, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "Error: --resume: o.h5.resume is not this command's run: " + words), lines
    assert saved.read_bytes() == before and not (tmp_path / "o.h5").exists()
    fresh = _invoke(args, monkeypatch, tmp_path)  # without --resume: refused, named
    assert fresh.exit_code == 1
    assert re.fullmatch(r"Error: o\.h5\.resume holds the state of an unfinished run of --out "
                        r"\(step \d+ of 3000\); add --resume to continue it, or --force to "
                        r"start over\n", fresh.output), fresh.output
    assert saved.read_bytes() == before
    over = _invoke([*args, "--force"], monkeypatch, tmp_path)  # starts over
    assert over.exit_code == 0, over.output
    assert not saved.exists() and (tmp_path / "o.h5").exists()
    missing = _invoke([*args, "--resume", "--force"], monkeypatch, tmp_path)
    assert missing.exit_code == 1
    assert missing.output.startswith("Error: --resume: no resume file o.h5.resume")


def test_resume_refuses_a_changed_input_file(tmp_path, monkeypatch):
    """The fingerprint covers the files the config names only by path: the rows file."""
    rows = np.random.default_rng(0).standard_normal((2, 40))
    np.save(tmp_path / "rows.npy", rows)
    (tmp_path / "spec.toml").write_text(SMALL_K2)
    args = ["run", "spec.toml", "--engine", "reduced", "--learner", "scratch", "--init-rows",
            "rows.npy", "--runs", "2", "--steps", "2000", "--eta", "0.01", "--checkpoints",
            "6", *QUIET, "--out", "o.h5"]
    assert _invoke([*args[:-2], "--out", "warm.h5"], monkeypatch, tmp_path).exit_code == 0
    assert _killed(tmp_path, args, 2, 500).returncode == -signal.SIGKILL
    np.save(tmp_path / "rows.npy", rows[::-1])  # same shape, other rows
    res = _invoke([*args, "--resume"], monkeypatch, tmp_path)
    assert res.exit_code == 1
    assert "the init_rows file changed since it was saved" in res.output, res.output
    np.save(tmp_path / "rows.npy", rows)
    assert _invoke([*args, "--resume"], monkeypatch, tmp_path).exit_code == 0


def test_show_describes_the_unfinished_run(tmp_path, monkeypatch):
    _killed_reduced(tmp_path)
    for target in ("o.h5", "o.h5.resume"):
        res = _invoke(["show", target], monkeypatch, tmp_path)
        assert res.exit_code == 0, res.output
        text = res.output
        assert re.search(r"^unfinished +step (\d+) of 3000 \([\d.]+%\), checkpoints \d+ of 8 "
                         r"recorded, 2 runs$", text, re.M), text
        assert re.search(r"^engine +reduced \(reduced/rank-1/numba\)$", text, re.M)
        assert re.search(r"^run +eta=0.002, steps=3000, runs=2", text, re.M)
        assert re.search(r"^resume with +loradyn run spec\.toml .* --out o\.h5 --resume$",
                         text, re.M), text
    info = json.loads(_invoke(["show", "o.h5", "--json"], monkeypatch, tmp_path).output)
    assert info["total"] == 3000 and 0 < info["step"] < 3000 and info["runs"] == 2
    assert info["config"]["eta"] == 0.002 and is_resume_file(tmp_path / "o.h5.resume")


def test_a_finished_run_removes_its_resume_file(tmp_path, monkeypatch):
    (tmp_path / "spec.toml").write_text(FINETUNE)
    res = _invoke(["run", "spec.toml", "--engine", "full", "--runs", "2", "--steps", "2000",
                   "--eta", "0.002", "--checkpoints", "6", *QUIET, "--out", "o.h5"],
                  monkeypatch, tmp_path, LORADYN_RESUME_SECONDS=0)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.h5", "spec.toml"]


# ---------------------------------------------------------------- in-process pieces
def test_a_resumed_chunk_schedule_continues_the_whole_one():
    steps = checkpoint_steps(5000, 12, "log")
    whole = list(iter_chunk_schedule(steps, 64))
    t = 0
    for i, (n, _) in enumerate(whole):
        t += n
        if i in (0, 3, 17, len(whole) - 2):
            assert list(iter_chunk_schedule(steps, 64, t)) == whole[i + 1:]
    with pytest.raises(ValueError, match="not a chunk end"):
        list(iter_chunk_schedule(steps, 64, 65))


def test_full_engine_state_round_trip_in_process():
    """FullRun saves its state at a chunk end and a new FullRun goes on from it."""
    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 30, "seed": 9},
                       eta=0.002, steps=3000, runs=2, checkpoints=8, label_noise=0.1,
                       finite_d_theory=False)
    saved = []
    whole = FullRun(config).run(checkpointer=Checkpointer(saved.append, interval=0))
    assert len(saved) >= 3
    for state in (saved[0], saved[len(saved) // 2]):
        run = FullRun(config)
        run.load_run_state(state)
        again = run.run()
        np.testing.assert_array_equal(again.overlap, whole.overlap)
        np.testing.assert_array_equal(again.loss, whole.loss)


def test_a_state_of_another_run_is_refused():
    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 30, "seed": 9},
                       eta=0.002, steps=500, runs=2, checkpoints=4, finite_d_theory=False)
    saved = []
    FullRun(config).run(checkpointer=Checkpointer(saved.append, interval=0))
    with pytest.raises(ResumeError, match="runs 2, this run 3"):
        start(replace(config, runs=3), resume=saved[0])
    reduced = replace(config, engine="reduced")
    with pytest.raises(ResumeError, match="full engine, this run takes the reduced"):
        start(reduced, resume=saved[0])
