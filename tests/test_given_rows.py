"""Initial rows given by the user (``--init-rows``, issue 17: "initial rows … or given")
against independent truths: inner products computed in the user's own coordinates, a Monte
Carlo loss in those coordinates, the zero loss of a student that starts at its teacher, the
same run written in either frame, and one-line errors for bad files."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.activations import get_activation
from dynamics.engines.engine import simulate
from dynamics.instances.instance import build_instance
from dynamics.learners.given_rows import canonical_rows, given_rows
from dynamics.measures.network_loss import network_loss_from_overlaps
from dynamics.setup.config import ConfigError, RunConfig
from sims.cli import cli
from sims.experiments.sweep_spec import cell_hash

ACT = "erf(x/sqrt2)"


def _explicit_spec(k=2, d=24, seed=1):
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((k, d)) / math.sqrt(d)
    return {"activation": ACT, "k": k, "d": d, "teacher": "committee", "W": w.tolist()}, w


def _save(tmp_path, name, arr):
    path = tmp_path / name
    np.save(path, np.asarray(arr))
    return str(path)


def _config(spec, init_rows, **kw):
    opts = dict(instance=spec, learner="scratch", eta=0.5 / spec["d"], steps=60, runs=2,
                checkpoints=4, seed=7, rows="free", init_rows=init_rows)
    return RunConfig(**(opts | kw)).validate()


def _cos(cross, tg, sg):
    return cross / np.sqrt(np.outer(np.diag(tg), np.diag(sg)))


# ---------------------------------------------------------------- the map to the frame
@pytest.mark.parametrize("k, kp, d", [(2, 3, 24), (3, 1, 9), (2, 5, 6), (4, 4, 8)])
def test_original_frame_keeps_every_inner_product(k, kp, d):
    """vᵢ = (Lᵢ, 0, …) in the instance's frame; mapped rows keep ⟨vᵢ, ŵⱼ⟩ and ⟨ŵⱼ, ŵₗ⟩
    (also when k + k′ > d, where the residuals span at most d − k dimensions)."""
    spec, w = _explicit_spec(k, d, seed=k + kp)
    inst = build_instance(spec)
    rows = np.random.default_rng(d).standard_normal((kp, d))
    canon = canonical_rows(rows, w)
    teacher = np.zeros((k, d))
    teacher[:, :k] = inst.w_factor
    np.testing.assert_allclose(teacher @ teacher.T, w @ w.T, atol=1e-13)
    np.testing.assert_allclose(teacher @ canon.T, w @ rows.T, atol=1e-12)
    np.testing.assert_allclose(canon @ canon.T, rows @ rows.T, atol=1e-12)


def test_canonical_frame_is_taken_as_it_is():
    rows = np.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(canonical_rows(rows, None), rows)


# ---------------------------------------------------------------- runs from given rows
def test_run_starts_where_the_user_put_the_rows(tmp_path):
    """Step 0 of a free-row run from rows in W's coordinates: the alignment is their cosine
    with W's rows, the loss is the Monte Carlo E(f* − f̂)² over x ~ N(0, I_d) in those same
    coordinates (and the overlap formula from inner products computed there)."""
    spec, w = _explicit_spec()
    gen = np.random.default_rng(3)
    rows = gen.standard_normal((3, spec["d"])) * 0.3
    config = _config(spec, _save(tmp_path, "rows.npy", rows))
    traj = simulate(config)
    act = get_activation(ACT)
    lam, lam_hat = np.ones(2), np.ones(3)  # equal λᵢ, fixed second layer: λ̂ = λ₁·1
    exact = network_loss_from_overlaps(act, lam, w @ w.T, lam_hat, rows @ rows.T, w @ rows.T)
    np.testing.assert_allclose(traj.loss[:, 0], exact, rtol=1e-12)
    x = gen.standard_normal((400_000, spec["d"]))
    e2 = (act.fn(x @ w.T) @ lam - act.fn(x @ rows.T) @ lam_hat) ** 2
    se = e2.std() / math.sqrt(e2.size)
    assert abs(e2.mean() - traj.loss[0, 0]) < 4 * se, (e2.mean(), traj.loss[0, 0], se)
    cos = _cos(w @ rows.T, w @ w.T, rows @ rows.T)
    np.testing.assert_allclose(traj.extra["alignment"][:, 0], np.abs(cos).max(1).mean(),
                               rtol=1e-12)
    assert traj.loss[0, -1] < traj.loss[0, 0]  # and SGD moves on from there


def test_the_same_rows_in_either_frame_give_the_same_run(tmp_path):
    spec, w = _explicit_spec()
    rows = np.random.default_rng(4).standard_normal((2, spec["d"])) * 0.2
    orig = simulate(_config(spec, _save(tmp_path, "o.npy", rows), init_frame="original"))
    canon = _save(tmp_path, "c.npy", canonical_rows(rows, w))
    same = simulate(_config(spec, canon, init_frame="canonical"))
    np.testing.assert_allclose(same.loss, orig.loss, rtol=1e-12)
    np.testing.assert_allclose(same.extra["alignment"], orig.extra["alignment"], rtol=1e-12)
    auto = simulate(_config(spec, _save(tmp_path, "a.npy", rows)))  # auto: original
    np.testing.assert_array_equal(auto.loss, orig.loss)


def test_a_student_started_at_a_finetuned_teacher_has_zero_loss(tmp_path):
    """Canonical frame of a fine-tuned teacher: vᵢ = (Lᵢ + ξcᵢu_w, ξcᵢ√(1 − α²), 0, …)/Nᵢ."""
    spec = {"activation": "tanh", "k": 3, "d": 12, "xi": 0.8, "u_alpha": 0.4,
            "W": "separated", "lam": "random_sign", "seed": 2}
    inst = build_instance(spec)
    v = np.zeros((3, 12))
    v[:, :3] = inst.w_factor + inst.xi * np.outer(inst.c, inst.u_w)
    v[:, 3] = inst.xi * inst.c * inst.u_perp
    v /= inst.teacher_norms()[:, None]
    for frame in ("canonical", "auto"):
        config = _config(spec, _save(tmp_path, "v.npy", v), rows="unit", init_frame=frame,
                         steps=5)
        traj = simulate(config)
        np.testing.assert_allclose(traj.loss[:, 0], 0.0, atol=1e-13)
        np.testing.assert_allclose(traj.extra["alignment"][:, 0], 1.0, rtol=1e-13)


def test_unit_rows_are_normalised_and_per_run_rows_start_each_run(tmp_path):
    spec, w = _explicit_spec(k=2, d=16)
    gen = np.random.default_rng(8)
    rows = gen.standard_normal((3, 2, 16)) * np.array([0.1, 5.0, 1.0])[:, None, None]
    traj = simulate(_config(spec, _save(tmp_path, "r.npy", rows), rows="unit", runs=3))
    for r in range(3):
        unit = rows[r] / np.linalg.norm(rows[r], axis=1, keepdims=True)
        want = np.abs(_cos(w @ unit.T, w @ w.T, np.eye(2))).max(1).mean()
        assert traj.extra["alignment"][r, 0] == pytest.approx(want, rel=1e-12)


def test_text_rows_read_like_npy(tmp_path):
    spec, _ = _explicit_spec()
    rows = np.random.default_rng(2).standard_normal((2, spec["d"]))
    txt = tmp_path / "rows.txt"
    np.savetxt(txt, rows, fmt="%.17g")
    a = simulate(_config(spec, str(txt), steps=10))
    b = simulate(_config(spec, _save(tmp_path, "rows.npy", rows), steps=10))
    np.testing.assert_array_equal(a.loss, b.loss)


def test_width_follows_the_rows_and_second_layer_draws_stay_seeded(tmp_path):
    spec, _ = _explicit_spec()
    rows = _save(tmp_path, "r.npy", np.ones((4, spec["d"])))
    traj = simulate(_config(spec, rows, train_second_layer=True, steps=10))
    assert traj.extra["lam_hat"].shape[-1] == 4
    again = simulate(_config(spec, rows, train_second_layer=True, steps=10))
    np.testing.assert_array_equal(traj.extra["lam_hat"], again.extra["lam_hat"])


# ---------------------------------------------------------------- provenance, hashes, CLI
def _run(args):
    return CliRunner().invoke(cli, ["run", *args])


def test_file_records_where_the_rows_came_from(tmp_path):
    spec, _ = _explicit_spec()
    spec_path = tmp_path / "s.json"
    spec_path.write_text(json.dumps(spec))
    rows = _save(tmp_path, "r.npy", np.ones((2, spec["d"])))
    out = tmp_path / "o.h5"
    res = _run([str(spec_path), "--learner", "scratch", "--rows", "free", "--init-rows", rows,
                "--steps", "20", "--runs", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    with h5py.File(out) as f:
        attrs = dict(f["extra/alignment"].attrs)
        config = json.loads(f.attrs["config"])
    with open(rows, "rb") as fh:
        assert attrs["init_rows_sha256"] == hashlib.sha256(fh.read()).hexdigest()
    assert attrs["init_frame"] == "original" and attrs["init_rows"] == rows
    assert list(attrs["init_rows_shape"]) == [2, spec["d"]]
    assert config["init_rows"] == rows and config["init_frame"] == "auto"
    shown = CliRunner().invoke(cli, ["show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert f"{rows} (shape (2, {spec['d']}), original frame, sha256 " \
        f"{attrs['init_rows_sha256']})" in shown.output
    assert "rows=free" in shown.output and f"<2×{spec['d']} array>" in shown.output
    info = json.loads(CliRunner().invoke(cli, ["show", str(out), "--json"]).output)
    assert info["init_rows"]["init_rows_sha256"] == attrs["init_rows_sha256"]
    assert info["extra"]["alignment"] == [2, info["datasets"]["steps"][0]]


def test_sweep_cell_hash_follows_the_rows_content(tmp_path):
    spec, _ = _explicit_spec()
    path = _save(tmp_path, "r.npy", np.ones((2, spec["d"])))
    config = _config(spec, path)
    before = cell_hash(config)
    assert cell_hash(_config(spec, path)) == before
    np.save(path, 2 * np.ones((2, spec["d"])))
    assert cell_hash(_config(spec, path)) != before


def test_hermite_committee_starts_from_the_given_rows(tmp_path):
    spec, _ = _explicit_spec(d=40)
    spec_path = tmp_path / "s.json"
    spec_path.write_text(json.dumps(spec))
    rows = _save(tmp_path, "r.npy", np.random.default_rng(1).standard_normal((2, 40)) / 6)
    out = tmp_path / "o.h5"
    common = ["--rows", "free", "--init-rows", rows, "--eta", "0.0125", "--steps", "200",
              "--checkpoints", "5"]
    assert _run([str(spec_path), "--learner", "scratch", *common, "--runs", "1",
                 "--out", str(out)]).exit_code == 0
    res = CliRunner().invoke(cli, ["hermite", "committee", str(spec_path), *common, "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    with h5py.File(out) as f:
        ode = f["extra/ode_loss"][0]
    assert got["loss"][0] == pytest.approx(ode[0], rel=1e-12)
    assert got["loss"][-1] == pytest.approx(ode[-1], rel=1e-9)
    assert "r.npy" in got["init"]
    res = CliRunner().invoke(cli, ["hermite", "committee", str(spec_path), *common,
                                   "--init-overlap", "0.1"])
    assert res.exit_code == 1 and "give one" in res.output


def _bad(tmp_path):
    spec, _ = _explicit_spec()
    d = spec["d"]
    zero = np.ones((2, d))
    zero[1] = 0
    files = {"bad_d.npy": np.ones((2, 5)), "nan.npy": np.full((2, d), np.nan),
             "zero.npy": zero, "r3.npy": np.ones((3, 2, d)), "rows.npy": np.ones((3, d)),
             "flat.npy": np.ones(d)}
    for name, arr in files.items():
        np.save(tmp_path / name, arr)
    (tmp_path / "junk.txt").write_text("not numbers\n")
    gauss = {"activation": ACT, "k": 2, "d": d, "teacher": "committee"}
    (tmp_path / "gauss.json").write_text(json.dumps(gauss))
    (tmp_path / "s.json").write_text(json.dumps(spec))


@pytest.mark.parametrize("args, message", [
    (["--init-rows", "missing.npy"], "'init_rows': missing.npy: no such file"),
    (["--init-rows", "bad_d.npy"], "rows have 5 coordinates but d = 24"),
    (["--init-rows", "nan.npy"], "NaN or infinite"),
    (["--init-rows", "zero.npy", "--rows", "unit"], "zero row cannot be put on the sphere"),
    (["--init-rows", "r3.npy", "--runs", "4"], "needs R = runs = 4, got 3"),
    (["--init-rows", "flat.npy"], "k′×d or R×k′×d array"),
    (["--init-rows", "junk.txt"], "cannot read rows"),
    (["--init-rows", "rows.npy", "--width", "2"], "'width': is 2 but --init-rows gives 3"),
    (["--init-rows", "rows.npy", "--init-scale", "2"], "'init_scale'"),
    (["--init-rows", "rows.npy", "--learner", "scratch-csq"], "needs k′ = k = 2 rows, got 3"),
    (["--init-rows", "rows.npy", "--learner", "sparse"], "takes no option 'init_rows'"),
    (["--init-rows", "rows.npy", "--init-frame", "original", "--spec", "gauss.json"],
     "'init_frame': 'original' needs the teacher's rows in coordinates"),
])
def test_bad_rows_are_one_line_errors_and_keep_results(tmp_path, monkeypatch, args, message):
    _bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    spec = "s.json"
    if "--spec" in args:
        i = args.index("--spec")
        spec, args = args[i + 1], args[:i] + args[i + 2:]
    learner = [] if "--learner" in args else ["--learner", "scratch"]
    rows = [] if "--rows" in args or "sparse" in args else ["--rows", "free"]
    Path("kept.h5").write_bytes(b"results already written")
    res = _run([spec, *learner, *rows, *args, "--steps", "10", "--out", "kept.h5", "--force"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error") and message in lines[0], res.output
    assert Path("kept.h5").read_bytes() == b"results already written"


def test_config_errors_name_the_option(tmp_path):
    spec, _ = _explicit_spec()
    with pytest.raises(ConfigError, match="init_rows"):
        _config(spec, str(tmp_path / "none.npy"))
    with pytest.raises(ConfigError, match="init_frame"):
        RunConfig(instance=spec, learner="scratch", eta=0.01, steps=5, init_frame="sideways")
    assert given_rows(_save(tmp_path, "r.npy", np.eye(2, 24))).width == 2


def test_sgd_from_one_given_start_tracks_its_ode_as_d_grows(tmp_path):
    """All runs from the same rows (sims.experiments.given_start, smaller): the SGD mean is
    within 4 SE of the one theory curve, and the per-run gap shrinks from d = 100 to 400.
    At η·d = 0.5 the curve is the diffusion's mean over 256 paths (its own Monte Carlo
    error ≈ the runs' spread/√256, counted in the SE); measured max |z| 3.9 and 2.3 (the
    deterministic ODE: 3.3 and 2.3)."""
    from sims.experiments import given_start

    rms = []
    for d in (100, 400):
        alpha, ode, sgd, _ = given_start.run(d, 24, 5.0, 2, tmp_path)
        se = sgd.std(0, ddof=1) * math.sqrt(1.0 / len(sgd) + 1.0 / 256)
        late = alpha >= 0.2
        z = np.abs(sgd.mean(0) - ode)[late] / se[late]
        assert z.max() < 4, (d, z.max())
        rms.append(float(np.sqrt(np.mean((sgd - ode) ** 2))))
    assert rms[1] < rms[0] / 1.5, rms  # d^{-1/2}: a factor 2 expected


@pytest.mark.parametrize("rows", ["free", "unit"])
def test_float32_run_started_at_its_teacher_keeps_its_ode(tmp_path, rows):
    """Student rows = teacher rows: the joint Gram is singular, and float32 rounding makes it
    indefinite by ~1e-8; the overlay repairs that rounding (Schur complement clipped), so
    the ODE is recorded, starting at loss ≈ 0 like SGD."""
    spec, w = _explicit_spec(k=2, d=30)
    start = w / np.linalg.norm(w, axis=1, keepdims=True) if rows == "unit" else w
    if rows == "unit":
        spec["W"] = start.tolist()
    traj = simulate(_config(spec, _save(tmp_path, "w.npy", start), rows=rows,
                            dtype="float32", steps=300))
    ode = traj.extra["ode_loss"]
    assert np.isfinite(ode).all()
    assert np.abs(ode[:, 0]).max() < 1e-5 and np.abs(traj.loss[:, 0]).max() < 1e-5


def test_rounding_repair_is_small_and_only_for_rounding():
    from dynamics.overlays.committee import rounding_repaired
    from hermite.committee import CommitteeState

    gen = np.random.default_rng(0)
    V = gen.standard_normal((2, 7)) / math.sqrt(7)
    T = V @ V.T
    Q = T.copy() - 3e-7 * np.eye(2)  # student = teacher, Q rounded down: indefinite
    state = CommitteeState.from_arrays(Q, T.copy(), np.ones(2))
    fixed = rounding_repaired(state, T, "free")
    joint = np.block([[fixed.Q, fixed.R], [fixed.R.T, T]])
    assert np.linalg.eigvalsh(joint)[0] > -1e-12
    assert np.abs(fixed.Q - Q).max() < 1e-6 and np.array_equal(fixed.R, state.R)
    far = CommitteeState.from_arrays(T - 0.1 * np.eye(2), T.copy(), np.ones(2))
    assert rounding_repaired(far, T, "free") is far  # a real error: the ODE names it
    ok = CommitteeState.from_arrays(np.eye(2) * 2, np.zeros((2, 2)), np.ones(2))
    assert rounding_repaired(ok, T, "free") is ok


def test_sweep_reads_init_rows_next_to_the_sweep_file(tmp_path, monkeypatch):
    """``init_rows = "rows.npy"`` in a sweep is relative to the sweep file (like its
    ``instance = "spec.toml"``), whatever the working directory; an axis of paths too."""
    folder = tmp_path / "study"
    folder.mkdir()
    np.save(folder / "rows.npy", np.eye(2, 12) * 0.5)
    other = np.zeros((2, 12))
    other[0, :2], other[1, 2] = (0.3, 0.4), 0.5  # alignment 0.7, not 1
    np.save(folder / "other.npy", other)
    (folder / "sweep.toml").write_text(
        '[sweep]\nname = "given"\n[base]\nlearner = "scratch"\nrows = "free"\n'
        'init_rows = "rows.npy"\nruns = 2\nsteps = 40\ncheckpoints = 4\n'
        '[base.instance]\nactivation = "erf(x/sqrt2)"\nteacher = "committee"\nk = 2\n'
        'd = 12\nW = "orthonormal"\n[axes]\neta = [0.01, 0.02]\n'
        '[[cases]]\ninit_rows = "rows.npy"\n[[cases]]\ninit_rows = "other.npy"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = CliRunner().invoke(cli, ["sweep", str(folder / "sweep.toml"), "--out", "s.h5"])
    assert res.exit_code == 0, res.output
    from sims.io.sweep import read_sweep

    _, cells = read_sweep("s.h5")
    used = sorted({c.config["init_rows"] for c in cells})
    assert used == [str(folder / "other.npy"), str(folder / "rows.npy")]
    for c in cells:  # the run started at the file's rows: cos with vᵢ is 1 or 0
        start = np.load(c.config["init_rows"])
        want = np.abs(start[:, :2] / np.linalg.norm(start, axis=1)[:, None]).max(0).mean()
        assert c.traj.extra["alignment"][0, 0] == pytest.approx(want, rel=1e-12)


def test_memory_estimate_counts_the_rows_file_and_its_width(tmp_path):
    """The budget (checked before allocation) takes k′ from the file and counts its array:
    the same as --width k′ plus the file's bytes."""
    from dynamics.engines.budget import estimate

    spec, _ = _explicit_spec(k=2, d=24)
    path = _save(tmp_path, "r.npy", np.ones((3, 6, 24)))
    given = estimate(_config(spec, path, runs=3, train_second_layer=True))
    width = estimate(_config(spec, None, runs=3, width=6, train_second_layer=True))
    assert given.parts.pop("given_rows") == 3 * 6 * 24 * 8
    assert given.parts == width.parts
