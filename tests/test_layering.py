"""Layering: the theory (``hermite``) stands alone, without torch and without the engine."""

import subprocess
import sys


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_hermite_imports_without_torch_or_engine():
    out = _fresh("import sys, hermite, hermite.activations, hermite.activations_numba\n"
                 "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                 "('torch', 'dynamics', 'sims')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_torch_side_matches_numpy_side():
    import numpy as np
    import torch

    from dynamics.activations import torch_activation
    from hermite.activations import activation_from_callable, get_activation

    x = np.linspace(-3.0, 3.0, 61)
    xt = torch.as_tensor(x)
    custom = activation_from_callable(np.sin, np.cos, name="sin")
    for act in [get_activation(n) for n in
                ("relu", "abs", "sigmoid", "tanh", "erf", "quadratic", "linear", "he3")] + [custom]:
        ta = torch_activation(act)
        assert ta.theory is act and ta.name == act.name
        for f_t, f_np in ((ta.fn, act.fn), (ta.deriv, act.deriv)):
            out = f_t(xt)
            assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
            np.testing.assert_allclose(out.numpy(), f_np(x), rtol=1e-14, atol=1e-14)
