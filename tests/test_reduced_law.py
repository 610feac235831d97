"""The reduced engine has the law of the full engine (two-sample KS and means), with power.

512 independent runs of each engine per setting (the full engine on its counter streams);
KS on the overlap (and ⟨ĉ,c⟩/‖ĉ‖ when ĉ is trained) at 5 checkpoints, Bonferroni-corrected
over every comparison in this module (family-wise level 1%); means within 4 standard
errors. A deliberately wrong chain (χ²_d in place of χ²_{d−k−2}) must be rejected, so the
comparison has power at these settings.
"""

import numpy as np
import pytest
from scipy.stats import ks_2samp

from dynamics.engines.engine import simulate_full
from dynamics.reduced import simulate_reduced
from dynamics.setup.config import RunConfig

RUNS = 512
ETA_C = 0.05
ALPHA = 0.01
# (d, activation, c with η = c/d, steps, joint ĉ, project, batch, label noise)
SETTINGS = [
    (d, act, c, steps, joint, True, 1, 0.0)
    for d, act, c, steps in ((50, "relu", 1.0, 400), (500, "relu", 1.0, 400),
                             (50, "he3", 0.3, 400), (500, "he3", 0.3, 1000))
    for joint in (False, True)
] + [
    (50, "relu", 1.0, 300, False, False, 1, 0.0),
    (50, "he3", 0.3, 300, True, False, 1, 0.0),
    (50, "relu", 1.0, 300, False, True, 4, 0.5),
]
N_COMPARISONS = 5 * sum(2 if s[4] else 1 for s in SETTINGS) + 5 * 2  # + numba vs torch
P_EACH = ALPHA / N_COMPARISONS


def _config(d, act, c, steps, joint, project, batch, noise, seed=1):
    return RunConfig(instance=dict(activation=act, k=8, d=d, xi=1.0, seed=3), eta=c / d,
                     eta_c=ETA_C, joint_c=joint, project=project, batch=batch,
                     label_noise=noise, steps=steps, runs=RUNS, seed=seed, checkpoints=6,
                     spacing="linear", engine="reduced", eval_size=256, streams="counter",
                     finite_d_theory=False)  # the theory overlay is not compared here
# streams = "counter": the full engine draws its examples from the counter-based streams
# (≈ 2× faster here at d = 500); their law is the default streams' (KS, with power:
# tests/test_learner_network_fast.py::test_counter_streams_same_law_ks), and the chain draws
# its own, so the comparison below is of the same two laws.


def _compare(a, b, what):
    """KS p-value and mean difference in standard errors, per checkpoint (columns 1..5)."""
    assert a.shape == b.shape and a.shape[1] == 6
    for j in range(1, 6):
        x, y = a[:, j], b[:, j]
        assert np.isfinite(x).all() and np.isfinite(y).all()
        assert x.std() > 1e-3, f"{what}: degenerate law at checkpoint {j}"
        p = ks_2samp(x, y).pvalue
        se = np.sqrt(x.var(ddof=1) / x.size + y.var(ddof=1) / y.size)
        assert p > P_EACH, f"{what}: KS rejects at checkpoint {j} (p = {p:.3g})"
        assert abs(x.mean() - y.mean()) < 4 * se, f"{what}: means differ at checkpoint {j}"


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_reduced_matches_full_engine_in_law(setting):
    config = _config(*setting)
    full = simulate_full(config)
    red = simulate_reduced(config)
    assert red.engine == "reduced" and (red.diverged_step < 0).all()
    _compare(full.overlap, red.overlap, "overlap")
    if config.options.joint_c:
        # same instance ⇒ same ĉ₀ in every run of both engines: exact at checkpoint 0
        np.testing.assert_allclose(full.c_overlap[:, 0], red.c_overlap[:, 0], rtol=1e-12,
                                   err_msg="c_overlap at step 0 differs between engines")
        _compare(full.c_overlap, red.c_overlap, "c_overlap")


def test_wrong_chi2_is_rejected():
    """χ²_d instead of χ²_{d−k−2} at d = 50: the same comparison must reject."""
    config = _config(50, "relu", 1.0, 400, False, True, 1, 0.0)
    full = simulate_full(config)
    wrong = simulate_reduced(config, _chi2_dof=config.instance["d"])
    pvals = [ks_2samp(full.overlap[:, j], wrong.overlap[:, j]).pvalue for j in range(1, 6)]
    assert min(pvals) < P_EACH


@pytest.mark.parametrize("joint,project", [(True, True), (False, False)])
def test_numba_and_torch_backends_agree_in_law(joint, project):
    config = _config(100, "relu", 1.0, 300, joint, project, 1, 0.0)
    a = simulate_reduced(config, backend="numba")
    b = simulate_reduced(config, backend="torch")
    _compare(a.overlap, b.overlap, "overlap numba vs torch")
