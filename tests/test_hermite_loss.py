"""Population loss Φ(m): −dΦ/dm = h (finite differences), minimum at the teacher."""

import numpy as np
import pytest

from dynamics.instances.instance import build_instance
from hermite import h, population_loss, population_loss_derivative


@pytest.mark.parametrize("spec", [
    dict(activation="relu", k=6, xi=1.3, W="separated", d=40, u_alpha=0.3, c="gaussian"),
    dict(activation="tanh", k=5, xi=2.0, lam="random_sign"),
    dict(activation="he3", k=4, xi=1.0, c_hat="gaussian"),
    dict(activation="abs", k=5, xi=3.0, c_hat="teacher"),
    dict(activation="sigmoid", k=3, xi=0.7, u_alpha=0.5),
])
def test_loss_derivative_is_minus_h(spec):
    inst = build_instance(dict(spec, seed=4))
    u = inst.u_perp
    m = np.array([-0.8, -0.3, 0.0, 0.25, 0.7]) * u
    eps = 1e-5
    fd = (population_loss(inst, m + eps) - population_loss(inst, m - eps)) / (2 * eps)
    np.testing.assert_allclose(-fd, h(inst, m), rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(population_loss_derivative(inst, m), -h(inst, m), rtol=1e-15)


def test_loss_vanishes_at_teacher_and_is_positive_elsewhere():
    inst = build_instance(dict(activation="relu", k=5, xi=1.0, seed=1, c_hat="teacher"))
    assert abs(float(population_loss(inst, 1.0))) < 1e-13
    m = np.linspace(-1, 0.99, 50)
    assert np.all(population_loss(inst, m) > 0)
    # Φ decreasing towards the teacher where h > 0
    assert np.all(np.diff(population_loss(inst, m))[h(inst, m[:-1]) > 0.05] < 0)


def test_loss_shape_and_errors():
    inst = build_instance(dict(activation="erf", k=3, seed=0))
    assert population_loss(inst, np.zeros((2, 2))).shape == (2, 2)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        population_loss(inst, -1.2)
