"""Issue 16, "nothing lost, nothing absurd": refused outputs, refused requests that cannot fit,
seed ranges, the step-size warning, ODE blow-ups, `show` on sweeps and checksummed files."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import TINY_SPEC_TOML, sweep_toml

from dynamics.engines import budget, engine
from dynamics.engines.engine import chunk_schedule, iter_chunk_schedule
from dynamics.instances.instance import build_instance
from dynamics.randomness.sampling import NoiseSource, NoiseStreams
from dynamics.setup.config import ConfigError, RunConfig
from sims.cli import cli
from sims.io import trajectory as traj_io
from sims.io.outputs import Input, Output, OutputError, check_outputs
from sims.io.sweep import read_sweep
from sims.io.trajectory import TrajectoryFileError, read_trajectory

SPEC = TINY_SPEC_TOML
BIG = 'activation = "relu"\nk = 5\nd = 2000\nxi = 1.0\nseed = 9\n'
HUGE = 'activation = "relu"\nk = 5\nd = 1000000\nxi = 1.0\nseed = 9\n'
# the full engine: these tests are about its memory, interruption and writing
FAST = ["--eta", "0.002", "--steps", "200", "--runs", "4", "--checkpoints", "8", "--engine", "full"]
SWEEP = sweep_toml(name="tiny")
SCALING = """
[scaling]
d = [30, 60]
c = 0.05
horizon = 20
level = 0.5
epsilon = 0.3
checkpoints = 20
n_boot = 50
[base]
runs = 4
[base.instance]
activation = "relu"
k = 3
xi = 1.0
c_hat = "teacher"
seed = 1
"""


@pytest.fixture
def here(spec_dir):
    return spec_dir


def md5(path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def invoke(*args, **kw):
    return CliRunner().invoke(cli, [str(a) for a in args], **kw)


def one_line_error(res, code=1) -> str:
    text = res.output.strip()
    assert res.exit_code == code, text
    errors = [ln for ln in text.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1, text
    return errors[0]


def no_compute(monkeypatch):
    """Any simulation (or figure) from here on is a test failure."""
    def boom(*_a, **_k):
        raise AssertionError("computed before refusing")

    monkeypatch.setattr(engine, "simulate_full", boom)
    monkeypatch.setattr(engine.FullRun, "__init__", boom)


# ---------------------------------------------------------------- 1. outputs
@pytest.mark.parametrize("content, kind", [(b"precious notes\n", "text file"),
                                           (b"\x89PNG\r\n\x1a\nxx", "PNG figure")])
def test_run_refuses_to_overwrite_an_existing_file(here, monkeypatch, content, kind):
    Path("keep.h5").write_bytes(content)
    before = md5("keep.h5")
    no_compute(monkeypatch)
    line = one_line_error(invoke("run", "spec.toml", *FAST, "--out", "keep.h5"))
    assert "--out keep.h5 exists" in line and kind in line and "--force" in line
    assert md5("keep.h5") == before


def test_run_force_replaces_and_refuses_a_sweep_file_without_it(here):
    Path("s.toml").write_text(SWEEP)
    assert invoke("sweep", "s.toml", "--out", "sw.h5").exit_code == 0
    before = md5("sw.h5")
    line = one_line_error(invoke("run", "spec.toml", *FAST, "--out", "sw.h5"))
    assert "loradyn sweep file" in line and md5("sw.h5") == before
    res = invoke("run", "spec.toml", *FAST, "--out", "sw.h5", "--force")
    assert res.exit_code == 0, res.output
    assert read_trajectory("sw.h5")[0].runs == 4


def test_interrupted_forced_run_keeps_the_old_file(here, monkeypatch):
    from dynamics import learners
    assert invoke("run", "spec.toml", *FAST, "--out", "keep.h5").exit_code == 0
    before = md5("keep.h5")

    def interrupt(self, state, x, pre, i):
        raise KeyboardInterrupt

    monkeypatch.setattr(learners.Finetune, "step_prepared_", interrupt)
    res = invoke("run", "spec.toml", *FAST, "--out", "keep.h5", "--force")
    assert res.exit_code != 0 and md5("keep.h5") == before


@pytest.mark.parametrize("args, needle", [
    (["--out", "spec.toml"], "--out spec.toml is the input SPEC"),
    (["--out", "x.h5", "--plot", "spec.toml"], "--plot spec.toml is the input SPEC"),
    (["--out", "x.png", "--plot", "x.png"], "--out and --plot are the same file x.png"),
    (["--out", "x.h5", "--plot", "./x.h5"], "--out and --plot are the same file"),
    (["--out", "x.h5", "--plot", "x.xyz"], "--plot x.xyz: the extension must be .png"),
    (["--out", "x.h5", "--plot", "figs/"], "--plot figs/ is a directory"),
    (["--out", "x.txt"], "--out x.txt: an HDF5 output needs a .h5"),
    (["--out", "spec.toml/x.h5"], "spec.toml is not a directory"),
])
def test_bad_output_paths_are_refused_before_any_compute(here, monkeypatch, args, needle):
    Path("figs").mkdir()
    before = md5("spec.toml")
    no_compute(monkeypatch)
    line = one_line_error(invoke("run", "spec.toml", *FAST[:-2], *args))
    assert needle in line, line
    assert md5("spec.toml") == before and not Path("x.h5").exists()


def test_same_file_by_symlink_is_caught(here):
    Path("link.toml").symlink_to("spec.toml")
    with pytest.raises(OutputError, match="is the input SPEC"):
        check_outputs([Output("--out", "link.toml", "text")], [Input("SPEC", "spec.toml")])


def test_read_only_file_is_refused_even_with_force(here):
    Path("ro.h5").write_text("x")
    Path("ro.h5").chmod(0o444)
    try:
        with pytest.raises(OutputError, match="read-only"):
            check_outputs([Output("--out", "ro.h5")], force=True)
    finally:
        Path("ro.h5").chmod(0o644)


def test_plot_refuses_existing_and_input_files(here):
    assert invoke("run", "spec.toml", *FAST, "--out", "r.h5").exit_code == 0
    Path("fig.png").write_bytes(b"not mine")
    before = md5("fig.png")
    line = one_line_error(invoke("plot", "r.h5", "--out", "fig.png"))
    assert "--out fig.png exists" in line and md5("fig.png") == before
    res = invoke("plot", "r.h5", "--out", "fig.png", "--force")
    assert res.exit_code == 0 and Path("fig.png").read_bytes()[:4] == b"\x89PNG"
    Path("r.svg").write_bytes(Path("r.h5").read_bytes())  # an input with a figure name
    line = one_line_error(invoke("plot", "r.svg", "--out", "r.svg"))
    assert "is the input FILES" in line


def test_sweep_force_replaces_a_foreign_file_only(here):
    Path("s.toml").write_text(SWEEP)
    Path("text.h5").write_text("notes")
    line = one_line_error(invoke("sweep", "s.toml", "--out", "text.h5"))
    assert "is not a loradyn sweep file" in line and Path("text.h5").read_text() == "notes"
    line = one_line_error(invoke("sweep", "s.toml", "--out", "s.toml"))
    assert "is the input SPEC" in line
    res = invoke("sweep", "s.toml", "--out", "text.h5", "--force")
    assert res.exit_code == 0, res.output
    assert len(read_sweep("text.h5")[1]) == 2
    res = invoke("sweep", "s.toml", "--out", "text.h5")  # a sweep file: resumed, not refused
    assert res.exit_code == 0 and "2 finished, 0 to run" in res.output


def test_scaling_refuses_a_foreign_figure_before_computing(here, monkeypatch):
    Path("sc.toml").write_text(SCALING)
    Path("mine.png").write_bytes(b"\x89PNG\r\n\x1a\nmy own figure")
    before = md5("mine.png")
    no_compute(monkeypatch)
    line = one_line_error(invoke("scaling", "sc.toml", "--out", "sc.h5", "--plot", "mine.png"))
    assert "--plot mine.png exists" in line and md5("mine.png") == before
    assert not Path("sc.h5").exists()


def test_reproduce_refuses_a_foreign_data_file(tmp_path, monkeypatch):
    (tmp_path / "fig1_quick.h5").write_text("not a sweep")
    before = md5(tmp_path / "fig1_quick.h5")
    no_compute(monkeypatch)
    line = one_line_error(invoke("reproduce", "fig1", "--quick", "--out-dir", tmp_path))
    assert "fig1_quick.h5 exists and is not a loradyn sweep file" in line
    assert md5(tmp_path / "fig1_quick.h5") == before


# ---------------------------------------------------------------- 2. requests that cannot fit
def test_huge_request_is_refused_before_allocating(here, monkeypatch):
    Path("huge.toml").write_text(HUGE)
    no_compute(monkeypatch)
    res = invoke("run", "huge.toml", "--runs", 10**7, "--steps", 10**7, "--eta", "1e-7",
                 "--out", "h.h5")
    line = one_line_error(res)
    assert line.startswith("Error: --runs 10000000 needs ") and "available;" in line
    assert "state " in line and "checkpoints " in line and not Path("h.h5").exists()


def test_refusal_says_how_many_runs_fit(here, monkeypatch):
    Path("big.toml").write_text(BIG)
    monkeypatch.setenv("LORADYN_MEMORY", "2G")
    no_compute(monkeypatch)
    line = one_line_error(invoke("run", "big.toml", "--engine", "full", "--runs", 300000,
                                 "--steps", 100,
                                 "--eta", "1e-5", "--out", "b.h5"))
    assert "2 GiB available" in line
    fit = int(line.split("at most ")[1].split(" runs fit")[0])
    cfg = RunConfig(instance=build_instance_spec(BIG), eta=1e-5, steps=100, runs=fit)
    assert budget.estimate(cfg).total <= budget.FRACTION * 2**31
    cfg.runs = int(fit * 1.2) + 100
    assert budget.estimate(cfg).total > budget.FRACTION * 2**31
    monkeypatch.setenv("LORADYN_MEMORY", "64G")  # the same request then goes through the check
    assert budget.check_memory(RunConfig(instance=build_instance_spec(BIG), eta=1e-5,
                                         steps=100, runs=fit)).total > 0


def build_instance_spec(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def test_engine_refuses_too(monkeypatch):
    monkeypatch.setenv("LORADYN_MEMORY", "1M")
    cfg = RunConfig(instance=build_instance_spec(SPEC), eta=1e-3, steps=10, runs=10**6)
    with pytest.raises(budget.MemoryBudgetError, match=r"runs = 1000000 needs .* available"):
        engine.simulate(cfg)


def test_estimate_is_close_to_the_engine_and_grows_with_runs():
    cfg = RunConfig(instance=build_instance_spec(BIG), eta=1e-5, steps=100, runs=4000)
    a = budget.estimate(cfg)
    cfg.runs = 1000
    b = budget.estimate(cfg)
    # measured peak RSS grew by 220 MB from R = 1000 to 4000 (module docstring)
    assert 150e6 < a.total - b.total < 300e6
    assert set(a.parts) >= {"state", "examples", "generators", "checkpoints"}


def test_available_memory_override_and_parse(monkeypatch):
    monkeypatch.setenv("LORADYN_MEMORY", "1.5G")
    assert budget.available_memory() == int(1.5 * 2**30)
    monkeypatch.delenv("LORADYN_MEMORY")
    avail = budget.available_memory()
    assert avail is None or avail > 0


def test_chunk_schedule_is_lazy_and_matches_the_list():
    steps = np.array([0, 1, 5, 40, 10**13])
    gen = iter_chunk_schedule(steps, 16)
    first = [next(gen) for _ in range(6)]
    assert first == chunk_schedule(np.array([0, 1, 5, 40]), 16) + [(16, False)]
    assert chunk_schedule(steps[:4], 16) == list(iter_chunk_schedule(steps[:4], 16))


def test_noise_chunks_take_a_generator():
    import itertools

    import torch

    with NoiseSource(NoiseStreams(0), 2, 1, 8, device=torch.device("cpu"),
                     dtype=torch.float64, chunk_steps=4) as src:
        sizes = (n for n, _ in iter_chunk_schedule(np.array([0, 10**12]), 4))
        got = [buf.clone() for buf, _ in itertools.islice(src.chunks(sizes), 3)]
    with NoiseSource(NoiseStreams(0), 2, 1, 8, device=torch.device("cpu"),
                     dtype=torch.float64, chunk_steps=4) as src:
        ref = [buf.clone() for buf, _ in src.chunks([4, 4, 4])]
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_hermite_ode_long_horizon_finishes_at_the_fixed_point(here):
    res = invoke("hermite", "ode", "spec.toml", "--eta", "1e-3", "--steps", 10**11,
                 "--checkpoints", "5", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["steps"][-1] == 10**11 and abs(out["m"][0][-1]) == pytest.approx(1.0)
    assert out["steps_to_reach_discrete"]["0.5"][0] is not None


# ---------------------------------------------------------------- 3. seeds
@pytest.mark.parametrize("seed", [2**64, 2**63, -1])
def test_seed_out_of_range_is_refused_naming_the_option(here, monkeypatch, seed):
    no_compute(monkeypatch)
    line = one_line_error(invoke("run", "spec.toml", *FAST, "--seed", seed, "--out", "s.h5"))
    assert "--seed" in line and "2**63" in line and str(seed) in line
    assert not Path("s.h5").exists()


def test_largest_seed_is_stored(here):
    res = invoke("run", "spec.toml", *FAST, "--seed", 2**63 - 1, "--out", "s.h5")
    assert res.exit_code == 0, res.output
    _, meta = read_trajectory("s.h5")
    assert meta["seed"] == 2**63 - 1 and meta["config"]["seed"] == 2**63 - 1


def test_instance_seed_out_of_range_is_refused(here, monkeypatch):
    Path("bad.toml").write_text(SPEC.replace("seed = 9", f"seed = {2**63 - 2}"))
    no_compute(monkeypatch)
    line = one_line_error(invoke("run", "bad.toml", *FAST, "--instance-seeds", "per_run",
                                 "--out", "s.h5"))
    assert "key 'seed'" in line and "per_run" in line


def test_config_validates_the_seed():
    with pytest.raises(ConfigError, match="seed"):
        RunConfig(instance=build_instance_spec(SPEC), seed=2**64).validate()


# ---------------------------------------------------------------- 4. step sizes
def test_sgd_step_limit_is_the_inverse_rms_gradient():
    from hermite.finite_d.noise import noise_moments
    from hermite.finite_d.stability import SAMPLES, sgd_step_limit, step_limit

    inst = build_instance({"activation": "relu", "k": 5, "d": 200, "seed": 9})
    lim = sgd_step_limit(inst)
    nm = noise_moments(inst, [0.0], d=200, samples=SAMPLES)
    assert lim == pytest.approx(1 / math.sqrt(nm.e_s2_px2[0]))
    # E[g²‖Px‖²] ≈ d E[g²]: the limit scales as 1/√d
    assert sgd_step_limit(inst, 800) == pytest.approx(lim / 2, rel=0.05)
    assert not step_limit(inst, 2.5e-4).exceeded  # the default η = 0.05/d
    big = step_limit(inst, 1e3)
    assert big.exceeded and big.kind == "sgd" and big.angle > 89
    assert "did you mean 0.001?" in big.message()


def test_ode_step_limit_is_euler_stability():
    from hermite import population_ode
    from hermite.finite_d.stability import ode_step_limit

    inst = build_instance({"activation": "relu", "k": 5, "seed": 9})
    lim = ode_step_limit(inst)
    steps = np.arange(0, 2001, 100)
    ok, blow = population_ode(inst, 0.5 * lim, [0.05, -0.3], steps, return_blowup=True)
    assert np.all(np.isfinite(ok)) and np.all(blow < 0)
    _, blow = population_ode(inst, 1e3 * lim, [0.05, -0.3], steps, return_blowup=True)
    assert np.all(blow >= 0)


def test_sgd_far_above_the_limit_is_noise(here):
    """The docstring's claim: at 10 η_sgd the overlaps stay at the noise level 1/√d."""
    from hermite.finite_d.stability import sgd_step_limit

    inst = build_instance({"activation": "relu", "k": 3, "d": 100, "seed": 9})
    eta = 10 * sgd_step_limit(inst)
    cfg = RunConfig(instance={"activation": "relu", "k": 3, "d": 100, "seed": 9}, eta=eta,
                    steps=3000, runs=16, checkpoints=5, finite_d_theory=False)
    traj = engine.simulate(cfg)
    assert np.sqrt(np.mean(traj.overlap[:, -1] ** 2)) < 3 / math.sqrt(100)


def test_run_warns_on_a_step_size_far_above_the_limit(here):
    res = invoke("run", "spec.toml", "--eta", "1e3", "--steps", "200", "--runs", "4",
                 "--out", "w.h5", "--json")
    assert res.exit_code == 0, res.output
    assert "warning: --eta 1000 is " in res.stderr and "did you mean 0.001?" in res.stderr
    assert "population ODE blew up in 4 run(s)" in res.stderr
    data = json.loads(res.stdout)
    assert data["health"]["ode_blowup"]["ode"][0] == 4 and data["health"]["left_sphere"] == 0
    with h5py.File("w.h5", "r") as f:
        assert f["ode"].attrs["blowup_runs"] == 4 and f["ode"].attrs["blowup_step"] >= 1
    traj, _ = read_trajectory("w.h5")
    assert not np.isinf(traj.ode).any() and np.isnan(traj.ode[:, -1]).all()
    res = invoke("run", "spec.toml", *FAST, "--out", "fine.h5")
    assert res.exit_code == 0 and "warning" not in res.output


def test_hermite_ode_warns_and_flags_the_blowup(here):
    res = invoke("hermite", "ode", "spec.toml", "--eta", "1e3", "--checkpoints", "4", "--json")
    assert res.exit_code == 0, res.output
    assert "warning: --eta 1000" in res.stderr and "blew up" in res.stderr
    out = json.loads(res.stdout)
    assert out["blowup_step"] == [1] and out["m"][0][1:] == [None] * (len(out["steps"]) - 1)
    assert out["step_limit"]["kind"] == "sgd" and out["step_limit"]["ratio"] > 1e3


# ---------------------------------------------------------------- 5. ODE blow-up flags
def test_population_ode_stops_at_a_blowup_instead_of_inf():
    from hermite import population_ode
    inst = build_instance({"activation": "relu", "k": 5, "seed": 9})
    steps = np.array([0, 1, 2, 5, 100])
    for method in ("table", "exact"):
        out, blow = population_ode(inst, 1e3, [0.07, 0.2], steps, method=method,
                                   return_blowup=True)
        assert not np.isinf(out).any() and np.all(out[:, 0] == [0.07, 0.2])
        assert np.all(blow >= 1) and np.isnan(out[:, -1]).all()


def test_fixed_point_skip_and_progress_pieces_are_exact(monkeypatch):
    import hermite.flows.ode as ode_mod

    inst = build_instance({"activation": "relu", "k": 5, "seed": 9})  # h > 0: m → 1
    m0 = np.array([0.05, 0.3, 0.9])
    steps = np.array([0, 10, 5000, 40_000, 200_000])
    ref = ode_mod.population_ode(inst, 1e-3, m0, steps)
    monkeypatch.setattr(ode_mod, "PIECE_STEPS", 777)
    np.testing.assert_array_equal(ode_mod.population_ode(inst, 1e-3, m0, steps,
                                                         progress=True), ref)
    # the map step by step to 10¹² steps: the runs reach a fixed point in floating point
    # (monotone, bounded) and the rest is skipped, with the numbers of iterating
    monkeypatch.setattr(ode_mod, "MAP_STEPS_MAX", 10**13)
    longer = ode_mod.population_ode(inst, 1e-3, m0, np.append(steps, 10**12))
    np.testing.assert_array_equal(longer[:, :-1], ref)
    np.testing.assert_array_equal(longer[:, -1], ref[:, -1])  # frozen by step 200000


def test_lna_variance_blowup_is_flagged():
    from hermite.finite_d.corrected_ode import VAR_BLOWUP, _lna

    fine = 513
    theta = np.linspace(0.0, math.pi, fine)
    drift = 0.1 * np.cos(theta)  # D(μ) = 0.1 μ: unstable at 0, the linearised variance grows
    mean, var, blow = _lna(np.array([0.01]), np.array([0.0]), np.array([0, 10, 100, 1000]),
                           drift, np.full(fine, 0.1), np.zeros(fine), np.full(fine, 1e-4),
                           theta[1] - theta[0], False, 1)
    assert 10 < blow[0] <= 100 and np.isnan(var[0, 2:]).all() and np.isnan(mean[0, 2:]).all()
    assert var[0, 1] <= VAR_BLOWUP


def test_blowup_index_ignores_curves_without_theory():
    from hermite.flows.ode import blowup_index

    curves = np.array([[0.1, 0.2, np.nan, np.nan], [np.nan] * 4, [0.1, 0.2, 0.3, 0.4]])
    assert blowup_index(curves).tolist() == [2, -1, -1]


# ---------------------------------------------------------------- 6. show on sweep files
def test_show_describes_a_sweep_file(here):
    from sims.experiments.sweep_spec import load_sweep
    from sims.io.sweep import finished_cells, rebuild_sweep_file

    Path("s.toml").write_text(SWEEP)
    assert invoke("sweep", "s.toml", "--out", "sw.h5").exit_code == 0
    res = invoke("show", "sw.h5")
    assert res.exit_code == 0, res.output
    assert "loradyn-sweep" in res.output and "xi = [0.5, 1.0]" in res.output
    assert "2 of 2 finished (complete)" in res.output and "cell_0001" in res.output
    info = json.loads(invoke("show", "sw.h5", "--json").output)
    assert (info["cells"], info["finished"], info["complete"]) == (2, 2, True)
    assert [c["axes"] for c in info["cell_list"]] == [{"xi": 0.5}, {"xi": 1.0}]
    assert info["cell_list"][0]["runs"] == 2
    spec = load_sweep("s.toml")
    cells = spec.cells()
    done = finished_cells("sw.h5")
    rebuild_sweep_file("sw.h5", spec, cells, {cells[0].hash: done[cells[0].hash]})
    res = invoke("show", "sw.h5")
    assert "1 of 2 finished (incomplete: 1 to run" in res.output
    assert json.loads(invoke("show", "sw.h5", "--json").output)["missing"] == 1


# ---------------------------------------------------------------- 7. checksums
def corrupt(path, dataset: str, nbytes: int = 4096, group: str | None = None) -> None:
    """Overwrite ``nbytes`` in the middle of the dataset's (first) chunk with other bytes."""
    with h5py.File(path, "r") as f:
        ds = f[dataset] if group is None else f[group][dataset]
        info = ds.id.get_chunk_info(0)
        offset, size = info.byte_offset, info.size
    assert size > nbytes
    start = offset + (size - nbytes) // 2
    with open(path, "r+b") as fh:
        fh.seek(start)
        old = fh.read(nbytes)
        fh.seek(start)
        fh.write(bytes((b + 1) % 256 for b in old))


def test_corrupted_dataset_is_a_one_line_error(here):
    assert invoke("run", "spec.toml", "--eta", "0.002", "--steps", "300", "--runs", "32",
                  "--checkpoints", "60", "--out", "c.h5").exit_code == 0
    with h5py.File("c.h5", "r") as f:
        assert f["overlap"].fletcher32 and f["ode"].fletcher32 and f["steps"].fletcher32
    corrupt("c.h5", "overlap")
    with pytest.raises(TrajectoryFileError, match="dataset 'overlap'.*checksum"):
        read_trajectory("c.h5")
    line = one_line_error(invoke("show", "c.h5"))
    assert "c.h5" in line and "'overlap'" in line and "corrupted" in line


def test_corrupted_sweep_cell_is_a_one_line_error(here):
    Path("s.toml").write_text(SWEEP.replace("runs = 2", "runs = 64"))
    assert invoke("sweep", "s.toml", "--out", "sw.h5").exit_code == 0
    corrupt("sw.h5", "overlap", 2048, group="cells/cell_0001")
    line = one_line_error(invoke("show", "sw.h5"))
    assert "cells/cell_0001/overlap" in line and "corrupted" in line


def test_files_without_checksums_still_read(here, monkeypatch):
    monkeypatch.setattr(traj_io, "CHECKSUM", False)
    assert invoke("run", "spec.toml", *FAST, "--out", "old.h5").exit_code == 0
    with h5py.File("old.h5", "r") as f:
        assert not f["overlap"].fletcher32 and f["overlap"].chunks is None
    traj, _ = read_trajectory("old.h5")
    assert traj.runs == 4 and invoke("show", "old.h5").exit_code == 0


def test_health_counts_runs_that_left_the_sphere_or_went_flat():
    from dynamics.runtime.trajectory import Trajectory
    from sims.commands.checks import health, health_text

    steps = np.array([0, 10, 20, 30, 40, 50])
    ov = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6],      # learning
                   [0.1, 0.2, 0.25, 0.25, 0.25, 0.25],  # stuck short of the teacher: flat
                   [0.1, 0.5, 0.9, 1.0, 1.0, 1.0],      # converged: not flat
                   [0.1, 0.2, np.nan, np.nan, np.nan, np.nan]])  # diverged
    ode = np.tile([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], (4, 1))
    ode[0, 3:] = np.nan  # the ODE of a healthy run blew up at step 30
    ode[3, 2:] = np.nan  # masked with its diverged run: not an ODE blow-up
    t = Trajectory(steps=steps, overlap=ov, loss=np.zeros_like(ov), ode=ode,
                   diverged_step=np.array([-1, -1, -1, 15]), xi=np.ones(4),
                   instance_seed=np.zeros(4, dtype=np.int64))
    report = health(t)
    assert report == {"left_sphere": 1, "flat": 1, "ode_blowup": {"ode": [1, 30]}}
    assert health_text(t) == "1 left the sphere, 1 went flat"


@pytest.mark.parametrize("exc", [MemoryError("Unable to allocate 149. GiB for an array"),
                                 RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_an_allocation_failure_the_estimate_missed_is_one_line(here, monkeypatch, exc):
    def fail(*_a, **_k):
        raise exc

    monkeypatch.setattr(engine.FullRun, "__init__", fail)
    line = one_line_error(invoke("run", "spec.toml", *FAST, "--out", "m.h5"))
    assert line.startswith("Error: out of memory (") and "lower --runs" in line
    assert not Path("m.h5").exists()


def test_reproduce_replaces_a_figure_its_readme_records_but_not_a_foreign_one(tmp_path):
    """A fresh clone has results/figN_quick.png and results/README.md (committed) but not the
    git-ignored figN_quick.h5: the figure is reproduce's own, so the default --out-dir works;
    a figure the README does not record is still refused, unchanged."""
    from sims.commands.reproduce import _claim_outputs
    from sims.io.outputs import OutputError

    results = Path(__file__).resolve().parents[1] / "results"
    for name in ("README.md", "fig2_quick.png"):
        (tmp_path / name).write_bytes((results / name).read_bytes())
    with _claim_outputs(["fig2"], True, tmp_path, True, "unit", False):
        pass
    (tmp_path / "README.md").write_text("# results/\n")
    before = md5(tmp_path / "fig2_quick.png")
    with pytest.raises(OutputError, match="fig2_quick.png exists .* not the figure of"):
        with _claim_outputs(["fig2"], True, tmp_path, True, "unit", False):
            pass
    assert md5(tmp_path / "fig2_quick.png") == before
