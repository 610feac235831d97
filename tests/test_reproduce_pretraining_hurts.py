"""``loradyn reproduce pretraining-hurts`` (issue 39, item 5): the paper's statistic, its
published tables as stored, the theory beside, the per-step recording of the chain, and the
quick target end to end (file, figure, table, ``loradyn show``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.randomness.sampling import run_seed
from dynamics.reduced import pretrained_chain as pc
from hermite.activations_numba import act_code
from hermite.flows.pretrained import escape_coefficients, flow_crossing_time, pretrained_flow
from sims.experiments import pretraining_hurts as ph


# ---------------------------------------------------------------- the paper's statistic
def test_window_statistic_by_hand():
    """Indices (0-based) 2, 3, 5 and 7 lie in [0.05, 0.15]: their mean is 17/4."""
    curve = [0.0, 0.04, 0.06, 0.1, 0.2, 0.14, 0.16, 0.15, 0.151]
    assert ph.window_statistic(curve, 0.1) == pytest.approx(17 / 4, abs=1e-15)
    assert ph.window_statistic(curve, 0.1, half_width=0.01) == pytest.approx(3.0)
    assert math.isnan(ph.window_statistic(curve, 0.5))


def test_published_tables_as_stored():
    """The tables of the paper's repository (its data_numerics_paper/*.npz), typed here."""
    mus = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    want = {"linear": (9.5, 20.5, 36, 45, 66.5, 106, 194, 457.5, 2038.5),
            "relu": (13, 30, 53, 79.5, 125, 191.5, 374.5, 903.5, 3978.5),
            "erf": (19.5, 57, 129, 265.5, 582, 1221, 3130, 9743, 52705.5),
            "sigmoid": (215, 470, 804.5, 1357.5, 2423.5, 4280, 9073.5, 24905, 114464)}
    for act, values in want.items():
        assert ph.PUBLISHED[act] == dict(zip(mus, map(float, values), strict=True)), act
    assert ph.PUBLISHED["he2"] == {0.1: 526.0, 0.2: 511.0, 0.4: 527.0, 0.5: 596.0,
                                   0.8: 2497.0, 0.9: 11766.5}
    assert set(ph.PUBLISHED_FILES) == set(ph.PUBLISHED) == set(ph.PUBLISHED_STD)
    for act, table in ph.PUBLISHED_STD.items():
        assert set(table) == set(ph.PUBLISHED[act])
        # a window of n consecutive indices has std √((n² − 1)/12): n = 13 for ReLU at 0.1
    assert ph.PUBLISHED_STD["relu"][0.1] == pytest.approx(math.sqrt((13**2 - 1) / 12), 1e-3)


# ---------------------------------------------------------------- theory beside
@pytest.mark.parametrize("mu", [0.1, 0.5, 0.9])
def test_asymptote_is_half_tau_log_d_over_eta(mu):
    """½τ ln d/η with τ in closed form: linear 2/(√(1 + 4(1−μ)²) − 1), ReLU twice that."""
    tau_lin = 2.0 / (math.sqrt(1.0 + 4.0 * (1.0 - mu) ** 2) - 1.0)
    for act, tau in (("linear", tau_lin), ("relu", 2.0 * tau_lin)):
        assert ph.asymptote_steps(act, mu, 1000, 0.2) == pytest.approx(
            0.5 * tau * math.log(1000) / 0.2, rel=1e-8)


def test_traps_are_roots_of_b():
    (mu3,) = ph.trap_mus("he3")
    assert mu3 == pytest.approx(0.32072, abs=1e-5)  # docs/theory/pretraining-hurts.md
    assert abs(escape_coefficients("he3", mu3)[0]) < 1e-10
    assert ph.asymptote_steps("he3", mu3, 1000, 0.2) > 1e6  # τ diverges there
    assert ph.trap_mus("relu") == [] and ph.trap_mus("he2") == []


def test_flow_crossing_time_against_the_dense_flow():
    """The event's t: the dense flow (same solver, t_eval) is at |m| = μ there, below it
    just before."""
    kw = dict(eta=0.2, d=1000, batch=500)
    t = flow_crossing_time("erf", 0.5, 1e-6, 0.02, 0.5, 1e4, **kw)
    flow = pretrained_flow("erf", 0.5, 1e-6, [0.02], [0.0, 0.99 * t, t], **kw)
    assert flow.overlap[0, 2] == pytest.approx(0.5, abs=1e-6)
    assert flow.overlap[0, 1] < 0.5 - 1e-3
    assert flow_crossing_time("erf", 0.5, 1e-6, 0.02, 0.5, 0.5 * t, **kw) == math.inf
    assert flow_crossing_time("erf", 0.5, 1e-6, 0.6, 0.5, 1.0, **kw) == 0.0


def test_paper_eta_is_their_lr_on_he_n():
    """One SGD step in R^d on Heₙ with lr 0.2/(n!·n) equals one on hₙ = Heₙ/√(n!) with
    ``paper_eta`` (explicit numpy step, He₃ = x³ − 3x)."""
    rng = np.random.default_rng(1)
    d, b, mu = 8, 5, 0.4
    u = np.eye(d)[0]
    x = rng.standard_normal((b, d))
    v = rng.standard_normal(d)
    v /= np.linalg.norm(v)

    def step(fn, dfn, lr, a=0.3):
        lam = x @ (mu * u + a * v)
        delta = (fn(lam) - fn(x @ u)) * dfn(lam)
        v_new = v - lr * a * delta @ x / b
        return a - lr * np.mean(delta * (x @ v)), v_new / np.linalg.norm(v_new)

    he3, dhe3 = (lambda z: z**3 - 3 * z), (lambda z: 3 * z**2 - 3)
    s6 = math.sqrt(6.0)
    theirs = step(he3, dhe3, 0.2 / (6 * 3))
    ours = step(lambda z: he3(z) / s6, lambda z: dhe3(z) / s6, ph.paper_eta("he3"))
    assert ph.paper_eta("relu") == 0.2 and ph.paper_eta("he3") == pytest.approx(0.2 / 3)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-12)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-12)


# ---------------------------------------------------------------- the chain, every step
def _settings(act="relu", mu=0.5, d=200, batch=20, eta=0.2):
    return pc.PretrainedSettings(act_code(act), mu, eta, batch, 0.0, d)


def test_recording_in_blocks_is_the_chains_numbers():
    """advance_recording in uneven blocks gives the records of one run_chain call at every
    step (each run's own stream)."""
    s, start = _settings(), pc.PretrainedStart(5, 6)
    whole = pc.run_chain(s, start, np.arange(0, 301))
    _, a_w, m_w = whole.records_masked()
    state = pc.initial_runs(s, start)
    blocks = [pc.advance_recording(s, state, n) for n in (7, 100, 1, 192)]
    np.testing.assert_array_equal(np.hstack([b[1] for b in blocks]), m_w[:, 1:])
    np.testing.assert_array_equal(np.hstack([b[0] for b in blocks]), a_w[:, 1:])
    assert all((b[2] < 0).all() for b in blocks)


def _small_spec(**kw):
    return ph.HurtsSpec(main=(("relu", 0.3),), hermite=(), runs=12, d=200, batch=100,
                        subsets=20, min_horizon=50, **kw)


def test_point_matches_first_passages_and_the_mean_curve():
    """measure_point's first passages are the chain's own (its stop-level kernel, same
    streams); its statistics are window_statistic on the mean of every-step records."""
    from dynamics.setup.config import RunConfig

    spec = _small_spec()
    point = ph.measure_point(spec, "relu", 0.3)
    cfg = RunConfig(instance={"activation": "relu", "k": 1, "d": 200, "seed": 0},
                    learner="pretrained-glm", mu=0.3, eta=0.2, batch=100,
                    steps=point["steps_run"], runs=12, seed=0, engine="reduced").validate()
    hits = pc.PretrainedChain().first_passages(cfg, [0.3])[0]
    np.testing.assert_array_equal(point["passages"], hits)
    run = pc.run_chain(spec.settings("relu", 0.3), pc.PretrainedStart(
        run_seed(0, 0, "data"), 12), np.arange(0, point["steps_run"] + 1))
    absm = np.abs(run.records_masked()[2][:, 1:])
    assert point["window_stat"] == pytest.approx(ph.window_statistic(absm.mean(0), 0.3),
                                                 abs=1e-9)
    subsets = ph._subsets(spec)
    for k in (0, 7):
        assert point["subset_stats"][k] == pytest.approx(
            ph.window_statistic(absm[subsets[k]].mean(0), 0.3), abs=1e-9)
    mean = absm.mean(0)
    assert point["mean_cross"] == np.argmax(mean >= 0.3) + 1
    assert point["never"] == 0
    assert math.isnan(point["published"])  # d = 200: the paper's tables do not apply


def test_runs_that_never_cross_are_counted():
    spec = _small_spec(max_horizon=3, horizon_factor=0.0)
    point = ph.measure_point(spec, "relu", 0.3)
    assert point["horizon"] == 3 and point["steps_run"] == 3
    assert point["never"] == 12 and np.isnan(point["passages"]).all()
    assert point["closed"] == 0.0 and "(open)" in ph.table_rows(ph.HurtsResult(
        spec, [point], 0.0))[0][5]  # the mean never left the window: the statistic says so
    assert ph.run_quantiles(point) == (math.inf, math.inf, math.inf)


# ---------------------------------------------------------------- the target end to end
def test_quick_target_end_to_end(tmp_path):
    from sims.cli import cli

    out = tmp_path / "res"
    res = CliRunner().invoke(cli, ["reproduce", "pretraining-hurts", "--quick", "--out-dir",
                                   str(out)])
    assert res.exit_code == 0, res.output
    h5, png = out / "pretraining-hurts_quick.h5", out / "pretraining-hurts_quick.png"
    assert h5.stat().st_size > 0 and png.stat().st_size > 10_000
    assert "paper stat." in res.output and "published" in res.output
    assert "pretraining-hurts-quick" in (out / "README.md").read_text()
    result = ph.read_hurts(h5)
    assert result.complete and {p["activation"] for p in result.points} >= {"relu", "he3"}
    relu = next(p for p in result.points if p["activation"] == "relu" and p["mu"] == 0.5)
    assert relu["published"] == 125.0 and relu["never"] == 0
    shown = CliRunner().invoke(cli, ["show", str(h5)])
    assert shown.exit_code == 0, shown.output
    rows = [line for line in shown.output.splitlines() if line.strip().startswith("relu")]
    assert len(rows) == 3 and "125" in rows[1]
    again = CliRunner().invoke(cli, ["reproduce", "pretraining-hurts", "--quick", "--out-dir",
                                     str(out)])  # resumed: every point reused
    assert again.exit_code == 0, again.output
    assert "resumed: 9 of 9 cells were already computed" in again.output
    assert ph.read_hurts(h5).points[0]["seconds"] == result.points[0]["seconds"]


def test_cli_refuses_another_convention(tmp_path):
    from sims.cli import cli

    res = CliRunner().invoke(cli, ["reproduce", "pretraining-hurts", "--quick", "--out-dir",
                                   str(tmp_path), "--convention", "appB"])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: pretraining-hurts runs on the pre-trained "
                                  "single-index model in the unit-row convention only, "
                                  "not 'appB'")
