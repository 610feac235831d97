"""The two settings of the network-chain benchmarks (``network_chain.py`` on one CPU thread,
``network_chain_gpu.py`` on a GPU and all cores): nn2pp's committee machine and the Claim 2
instance."""

from __future__ import annotations

from dynamics.setup.config import RunConfig

NN2PP_ERF = "erf(x/sqrt2)"


def committee_config(d: int, width: int, steps: int) -> RunConfig:
    """nn2pp's default: free rows of scale 1, T = I teacher, erf(x/√2), η = 0.5/d."""
    spec = {"activation": NN2PP_ERF, "k": width, "d": d, "teacher": "committee",
            "W": "orthonormal", "seed": 0}
    return RunConfig(instance=spec, learner="scratch", rows="free", eta=0.5 / d,
                     steps=steps, runs=1, seed=0, checkpoints=2,
                     finite_d_theory=False).validate()


def claim2_config(d: int, steps: int) -> RunConfig:
    spec = {"activation": "he3", "k": 4, "d": d, "xi": 1.0, "W": "claim2", "seed": 0,
            "c_hat": "teacher"}
    return RunConfig(instance=spec, learner="scratch", eta=0.5 / d, steps=steps, runs=1,
                     seed=0, checkpoints=2, finite_d_theory=False).validate()
