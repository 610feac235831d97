"""The fine-tuning regime travels as one object (issue 36, item 2): the object form and the
old keyword form of the public flows give identical arrays, and a bad regime is a one-line
error."""

from __future__ import annotations

import numpy as np
import pytest

import hermite
from dynamics.instances.instance import build_instance

SPEC = dict(activation="relu", k=3, d=40, xi=1.3, W="separated", c="gaussian",
            c_hat="gaussian", u_alpha=0.5, seed=2)


@pytest.fixture(scope="module")
def inst():
    return build_instance(SPEC)


def test_finetune_ode_object_form_is_the_keyword_form(inst):
    steps = np.array([0.0, 50.0, 200.0])
    mu0, c0 = np.array([0.2, -0.1]), inst.c_hat + 0.05
    p0 = np.array([[0.05, 0.0, -0.02], [0.0, 0.03, 0.0]])
    regime = hermite.FinetuneRegime(0.01, project=False, joint_c=True, eta_c=0.005, prox=0.1,
                                    d=inst.d, batch=2, label_noise=0.1)
    start = hermite.FinetuneStart(mu0=mu0, p0=p0, c_hat0=c0)
    solver = hermite.SolverSettings(rtol=1e-8)
    for corrected in (False, True):
        obj = hermite.finetune_ode(inst, regime, steps, start, solver=solver,
                                   corrected=corrected, escape=False)
        old = hermite.finetune_ode(inst, 0.01, steps, mu0=mu0, p0=p0, c_hat0=c0,
                                   project=False, joint_c=True, eta_c=0.005, prox=0.1,
                                   d=inst.d, batch=2, label_noise=0.1, rtol=1e-8,
                                   corrected=corrected, escape=False)
        for key in ("m", "c_overlap", "p", "mu", "c_hat"):
            assert np.array_equal(getattr(obj, key), getattr(old, key)), key
    level = 0.3
    assert np.array_equal(
        hermite.finetune_steps_to_reach(inst, regime, level, start),
        hermite.finetune_steps_to_reach(inst, 0.01, level, mu0=mu0, p0=p0, c_hat0=c0,
                                        project=False, joint_c=True, eta_c=0.005, prox=0.1))


def test_corrected_ode_table_of_the_regime_is_the_keyword_form():
    inst = build_instance(dict(activation="relu", k=5, d=200, xi=1.0, c_hat="quantized",
                               seed=1))
    m0, steps = np.array([0.05, 0.2]), np.array([0, 100, 1000])
    regime = hermite.FinetuneRegime(1e-3, d=200, label_noise=0.1)
    table = hermite.regime_table(inst, regime, samples=2**12)
    obj = hermite.corrected_ode(inst, regime.eta, regime.d, m0, steps, table=table)
    old = hermite.corrected_ode(inst, 1e-3, 200, m0, steps, label_noise=0.1, samples=2**12)
    assert np.array_equal(obj, old)
    band = hermite.theory_band(inst, regime.eta, regime.d, steps, m0=m0, table=table,
                               form=hermite.BandForm(method="gaussian"))
    old_band = hermite.theory_band(inst, 1e-3, 200, steps, m0=m0, method="gaussian",
                                   label_noise=0.1, samples=2**12)
    assert np.array_equal(band.lower, old_band.lower)
    with pytest.raises(TypeError, match="label_noise"):
        hermite.corrected_ode(inst, 1e-3, 200, m0, steps, table=table, label_noise=0.1)


@pytest.mark.parametrize("kw, err, needle", [
    (dict(eta=0.0), ValueError, "eta must be a finite number > 0"),
    (dict(eta=0.01, eta_c=-1.0), ValueError, "eta_c must be"),
    (dict(eta=0.01, batch=0), ValueError, "batch must be an integer ≥ 1"),
    (dict(eta=0.01, label_noise=-0.1), ValueError, "label_noise must be"),
    (dict(eta=0.01, prox=float("nan")), ValueError, "prox must be"),
])
def test_a_bad_regime_is_a_one_line_error(kw, err, needle):
    with pytest.raises(err, match=needle) as info:
        hermite.FinetuneRegime(**kw)
    assert "\n" not in str(info.value)


def test_an_unknown_or_doubled_keyword_is_a_type_error(inst):
    with pytest.raises(TypeError, match="unexpected keyword argument 'jointc'") as info:
        hermite.finetune_ode(inst, 0.01, [0, 10], m0=[0.1], jointc=True)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="batch must be"):
        hermite.finetune_ode(inst, 0.01, [0, 10], m0=[0.1], batch=0)
    regime = hermite.FinetuneRegime(0.01)
    with pytest.raises(TypeError, match="FinetuneRegime and its keyword"):
        hermite.finetune_ode(inst, regime, [0, 10], m0=[0.1], joint_c=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'd'"):
        from hermite.flows.linearized import linear_model_rank1_ode

        linear_model_rank1_ode(inst, np.eye(5)[3], 0.01, [0, 10], d=40)
