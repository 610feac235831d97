"""The CUDA backend of the reduced chain (one launch for all steps) under numba's CUDA
simulator, against the compiled CPU kernel: same streams, same numbers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dynamics.randomness.sampling import run_seed
from dynamics.reduced import _kernel
from dynamics.reduced.params import pack_instances
from dynamics.setup.config import RunConfig
from hermite.activations_numba import act_code

CASES = {  # name → (activation, project, joint, batch, label noise)
    "relu-frozen": ("relu", True, False, 1, 0.0),
    "he3-joint": ("he3", True, True, 1, 0.0),
    "tanh-unprojected-batch": ("tanh", False, True, 3, 0.1),
}

SCRIPT = textwrap.dedent('''
    import math, sys, warnings
    import numpy as np
    warnings.simplefilter("ignore")  # uint64 wrap-around of the interpreted RNG
    sys.path.insert(0, sys.argv[1])
    from tests.test_reduced_cuda_sim import advance_case
    from dynamics.reduced import cuda_kernel
    out = {name: advance_case(name, cuda_kernel.advance) for name in sys.argv[3:]}
    np.savez(sys.argv[2], **{f"{n}:{i}": a for n, arrs in out.items()
                             for i, a in enumerate(arrs)})
''')


def advance_case(name: str, advance):
    """Run case ``name`` through ``advance`` (CPU or CUDA driver); the result arrays."""
    act, project, joint, batch, noise = CASES[name]
    d, k, runs, steps = 40, 3, 5, 30
    cfg = RunConfig(instance={"activation": act, "k": k, "d": d, "xi": 1.0, "seed": 1,
                              "W": "separated", "u_alpha": 0.0 if project else 0.3},
                    eta=0.01, steps=steps, runs=runs, joint_c=joint, project=project,
                    batch=batch, label_noise=noise).validate()
    P = pack_instances(cfg.run_instances())
    states = np.zeros(runs, dtype=np.uint64)
    mu, nu = np.empty(runs), np.empty(runs)
    _kernel.init_runs(run_seed(0, 0, "data"), d - k, states, mu, nu)
    pw, chat = np.zeros((runs, k)), P.c_hat0.copy()
    cp = np.array([0, 7, steps], dtype=np.int64)
    cp_m, cp_mu, cp_nu = (np.zeros((runs, 3)) for _ in range(3))
    cp_pw = np.zeros((runs, 3, 0 if project else k))
    cp_chat = np.zeros((runs, 3, k if joint else 0))
    div, hit = np.full(runs, -1), np.full(runs, -1)
    code, hp = act_code(act)
    advance(project, joint, P.L, P.ident, P.prm, P.inst_idx, code, hp, d - k - 2, 0.01, 0.01,
            batch, math.sqrt(noise), states, mu, nu, pw, chat, steps, cp, cp_m, cp_mu, cp_nu,
            cp_pw, cp_chat, div, math.inf, True, hit)
    return cp_m, cp_mu, cp_nu, cp_pw, cp_chat, states.astype(np.float64), div


def test_cuda_kernel_in_simulator_equals_cpu_kernel(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_DISABLE_JIT="1")
    out = tmp_path / "cuda.npz"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, root, str(out), *CASES], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = np.load(out)
    for name in CASES:
        cpu = advance_case(name, _kernel.advance)
        for i, ref in enumerate(cpu):
            np.testing.assert_allclose(sim[f"{name}:{i}"], ref, rtol=1e-12, atol=1e-13,
                                       err_msg=f"{name}, array {i}")
        assert np.isfinite(cpu[0]).all() and np.ptp(cpu[0][:, -1]) > 0  # runs really moved


@pytest.mark.skipif(not os.environ.get("LORADYN_TEST_CUDA"), reason="set LORADYN_TEST_CUDA=1 "
                    "on a machine with a GPU")
def test_cuda_kernel_on_device_equals_cpu_kernel():  # pragma: no cover - needs a GPU
    from dynamics.reduced import cuda_kernel

    for name in CASES:
        for a, b in zip(advance_case(name, cuda_kernel.advance),
                        advance_case(name, _kernel.advance), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_backend_choice_errors():
    from dynamics.reduced.simulate import _choose_backend

    cfg = RunConfig(instance={"activation": "relu", "k": 2, "d": 10}, eta=0.01, steps=5)
    assert _choose_backend(cfg, None, "relu")[0] == "numba"
    with pytest.raises(ValueError, match="numba-cuda backend runs on device 'cuda' only"):
        _choose_backend(cfg, "numba-cuda", "relu")
    with pytest.raises(ValueError, match="backend must be one of"):
        _choose_backend(cfg, "opencl", "relu")
