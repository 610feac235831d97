"""CUDA backend of the reduced chain: one thread per run, every step in ONE kernel launch.

The kernel calls the same compiled step loop as the CPU driver (:func:`._chain.run_one`, which
allocates nothing: its scratch rows are slices of device arrays here), with the same per-run
SplitMix64 streams, so a run's numbers are those of the CPU ``numba`` backend up to
floating-point contraction (FMA) on the device. Checkpoints are written by the threads
themselves, so nothing returns to the host until the horizon (or every run's stop/divergence)
is reached: the launch overhead is paid once per call instead of once per step, as it is in
the vectorised torch backend (:mod:`.torch_chain`).

Tested on CPU with numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which executes the
same kernel source thread by thread.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import cuda

from ._chain import N_WORK_B, N_WORK_K, run_one

__all__ = ["advance", "THREADS_PER_BLOCK"]

THREADS_PER_BLOCK = 64


@cuda.jit
def _advance_kernel(project, joint, L_all, ident_all, prm_all, inst_idx, code, hp, dof, eta,
                    eta_c, batch, noise_sd, states, mu, nu, pw, chat, n_steps, cp_steps, cp_m,
                    cp_mu, cp_nu, cp_pw, cp_chat, div_step, stop_level, stop_abs, hit_step, wk,
                    wb, zs, no3, no2):
    r = cuda.grid(1)
    if r >= mu.shape[0]:
        return
    i = inst_idx[r]
    st, m_r, n_r, dv, ht = run_one(
        r, project, joint, L_all[i], ident_all[i], prm_all[i], code, hp, dof, eta, eta_c,
        batch, noise_sd, states[r], mu[r], nu[r], pw[r], chat[r], n_steps, cp_steps, cp_m,
        cp_mu, cp_nu, cp_pw, cp_chat, stop_level, stop_abs, no3, no2, no2, no2, no3, wk[r],
        wb[r], zs[r])
    states[r] = st
    mu[r] = m_r
    nu[r] = n_r
    div_step[r] = dv
    hit_step[r] = ht


def advance(project, joint, L_all, ident_all, prm_all, inst_idx, code, hp, dof, eta, eta_c,
            batch, noise_sd, states, mu, nu, pw, chat, n_steps, cp_steps, cp_m, cp_mu, cp_nu,
            cp_pw, cp_chat, div_step, stop_level, stop_abs, hit_step) -> None:
    """Same arguments and in-place results as :func:`._kernel.advance` (host numpy arrays);
    the state is copied to the device, advanced in one launch and copied back."""
    runs, k = chat.shape
    dev = {name: cuda.to_device(np.ascontiguousarray(a)) for name, a in (
        ("L", L_all), ("ident", ident_all), ("prm", prm_all), ("idx", inst_idx),
        ("states", states), ("mu", mu), ("nu", nu), ("pw", pw), ("chat", chat),
        ("cp", np.asarray(cp_steps, dtype=np.int64)), ("cp_m", cp_m), ("cp_mu", cp_mu),
        ("cp_nu", cp_nu), ("cp_pw", cp_pw), ("cp_chat", cp_chat), ("div", div_step),
        ("hit", hit_step))}
    wk = cuda.device_array((runs, N_WORK_K, k))
    wb = cuda.device_array((runs, N_WORK_B, batch))
    zs = cuda.device_array((runs, batch, k))
    no3 = cuda.device_array((0, 0, 0))
    no2 = cuda.device_array((0, 0))
    blocks = (runs + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    with warnings.catch_warnings():  # few runs → few blocks, by the caller's choice
        warnings.filterwarnings("ignore", message=".*Grid size .* under-utilization")
        _advance_kernel[blocks, THREADS_PER_BLOCK](
            project, joint, dev["L"], dev["ident"], dev["prm"], dev["idx"], code, hp, dof, eta,
            eta_c, batch, noise_sd, dev["states"], dev["mu"], dev["nu"], dev["pw"],
            dev["chat"], n_steps, dev["cp"], dev["cp_m"], dev["cp_mu"], dev["cp_nu"],
            dev["cp_pw"], dev["cp_chat"], dev["div"], stop_level, stop_abs, dev["hit"], wk, wb,
            zs, no3, no2)
    for name, host in (("states", states), ("mu", mu), ("nu", nu), ("pw", pw),
                       ("chat", chat), ("cp_m", cp_m), ("cp_mu", cp_mu), ("cp_nu", cp_nu),
                       ("cp_pw", cp_pw), ("cp_chat", cp_chat), ("div", div_step),
                       ("hit", hit_step)):
        host[...] = dev[name].copy_to_host()
