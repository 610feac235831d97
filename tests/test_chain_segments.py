"""The exact chains advance in segments (issue 38.2): any cut of the horizon into kernel calls
gives the numbers of one call, bit for bit, for every chain (rank-1 finetune on numba and on
torch, glm, rank-r lora, the network chain of scratch / sparse with unit, free and wide rows,
a committee teacher and diverging runs, the linearized chain); progress lines and signals come
between segments (``dynamics.engines.engine.drive_chain``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from dynamics.engines.engine import Interruption, interruptible, simulate, start
from dynamics.reduced.segments import Pace, run_to_end
from dynamics.setup.config import RunConfig

BASE = {"activation": "relu", "k": 3, "d": 60, "xi": 1.0, "seed": 2}
COMMITTEE = {"activation": "erf", "k": 2, "d": 80, "teacher": "committee", "seed": 3}


def _config(**kw) -> RunConfig:
    fields = dict(runs=4, checkpoints=9, engine="reduced", finite_d_theory=False) | kw
    return RunConfig(**fields)


CASES = {
    "rank-1": _config(instance=BASE, eta=0.02, steps=1500, seed=4),
    "rank-1-joint-unprojected-batch": _config(
        instance={**BASE, "activation": "tanh", "u_alpha": 0.3}, eta=0.02, steps=1200,
        joint_c=True, project=False, batch=2, label_noise=0.1, seed=1),
    "rank-1-torch": _config(instance={**BASE, "activation": "erf(x/sqrt2)"}, eta=0.02,
                            steps=600, joint_c=True, checkpoints=7),
    "glm": _config(instance={**BASE, "k": 1, "activation": "he3"}, learner="glm", eta=0.01,
                   steps=1500, label_noise=0.05),
    "rank-r": _config(instance={**BASE, "k": 4}, learner="lora", rank=2, eta=0.01, steps=1000,
                      joint_c=True),
    "committee": _config(instance=COMMITTEE, learner="scratch", eta=0.01, steps=1500),
    "committee-free-trained-batch": _config(
        instance=COMMITTEE, learner="scratch", rows="free", train_second_layer=True,
        eta=0.01, steps=1000, batch=2),
    # k′(t + 2k′ + 1) ≥ FUSE_MIN: the b = 1 pass draws the next step's example ahead
    "network-wide-fused": _config(instance={"activation": "relu", "k": 2, "d": 200, "seed": 3},
                                  learner="scratch", width=32, eta=0.002, steps=300, runs=3,
                                  checkpoints=6),
    "sparse": _config(instance=BASE, learner="sparse", eta=0.02, steps=800, runs=3),
    "linearized": _config(instance=BASE, learner="linearized", full_rank=True, eta=0.02,
                          steps=800, runs=3, batch=2),
    "network-diverging": _config(instance={"activation": "relu", "k": 2, "d": 40, "seed": 3},
                                 learner="scratch", rows="free", eta=0.6, steps=1000, runs=6),
}

SEGMENTS = (1, 0, 7, 13, 64, 3, 250, 29)  # cycled: cuts anywhere, around checkpoints too


def _arrays(traj) -> dict:
    out = {}
    for name in ("steps", "overlap", "loss", "ode", "c_overlap", "diverged_step", "m0",
                 "ode_corrected", "band_lower", "band_upper"):
        value = getattr(traj, name)
        if value is not None:
            out[name] = np.asarray(value)
    out |= {f"extra/{k}": np.asarray(v) for k, v in traj.extra.items()}
    return out


def _state(run) -> dict:
    if hasattr(run, "torch_run"):
        arrays, _ = run.torch_run.state()
        return {f"torch/{k}": v for k, v in arrays.items()}
    _, records = run.recorded()
    return ({f"per_run/{k}": v for k, v in run.per_run.items()}
            | {f"records/{k}": v for k, v in records.items()} | {"div": run.div})


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=True), f"{what}: {key} differs"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the diverging runs' theory overflows
def test_segments_give_the_numbers_of_one_call(name):
    config = CASES[name]
    one = start(config)
    one.advance(config.steps)  # one kernel call over the whole horizon
    assert one.finished and one.step == config.steps
    seg = start(config)
    sizes, i = [], 0
    while not seg.finished:
        seg.advance(SEGMENTS[i % len(SEGMENTS)])
        sizes.append(SEGMENTS[i % len(SEGMENTS)])
        i += 1
    assert len(sizes) > 5
    _assert_same(_state(one), _state(seg), f"{name}: state and records")
    ta, tb = one.trajectory(), seg.trajectory()
    _assert_same(_arrays(ta), _arrays(tb), f"{name}: trajectory")
    assert np.isfinite(ta.overlap[~ta.diverged][:, 1:]).all()  # (linearized: NaN at Δ = 0)
    if name == "network-diverging":
        assert ta.diverged.any()
    # the engine's own driver (adaptive segments) gives them too
    _assert_same(_arrays(simulate(config)), _arrays(ta), f"{name}: simulate")


def test_a_flagged_signal_stops_the_chain_at_a_segment_end(monkeypatch):
    config = CASES["rank-1"]
    monkeypatch.setenv("LORADYN_SEGMENT_STEPS", "100")
    with interruptible() as stop:
        stop.signum = signal.SIGINT  # as the handler does on the first signal
        traj = simulate(config)
    monkeypatch.delenv("LORADYN_SEGMENT_STEPS")
    assert isinstance(stop, Interruption) and stop.step == 100
    whole = simulate(config)
    n = traj.steps.size
    assert whole.steps[n - 1] <= 100 < whole.steps[n]
    np.testing.assert_array_equal(traj.steps, whole.steps[:n])
    np.testing.assert_array_equal(traj.overlap, whole.overlap[:, :n])


def test_pace_aims_at_the_segment_time_and_grows_by_bounded_factors():
    pace = Pace(seconds=0.5)
    assert pace.next() == 64
    pace.took(64, 0.001)  # 64k steps/s: 16 × at most
    assert pace.next() == 64 * 16
    pace.took(1024, 1.0)  # 1024 steps/s: 512 steps to half a second
    assert pace.next() == 512
    assert Pace(fixed=7).next() == 7
    run = start(CASES["glm"])
    run_to_end(run, pace=Pace(fixed=400))
    assert run.finished and run.step == CASES["glm"].steps


MAIN = "import sys; from sims.cli import main; sys.argv[0] = 'loradyn'; main()"


def _loradyn(tmp_path, *args, env=None, timeout=300):
    full = {k: v for k, v in os.environ.items() if not k.startswith("LORADYN_TEST_")}
    return subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True,
                          cwd=tmp_path, env=full | (env or {}), timeout=timeout)


def test_reduced_run_prints_progress_lines_and_stops_on_a_signal(tmp_path):
    """`loradyn run` on the exact chain, stderr a file: progress lines between segments;
    SIGTERM after 3 segments stops it there, the checkpoints reached written and marked."""
    simulate(CASES["rank-1"])  # compile (or load) the kernel here: the subprocess loads it
    (tmp_path / "s.toml").write_text('activation = "relu"\nk = 3\nd = 60\nxi = 1.0\nseed = 2\n')
    args = ["run", "s.toml", "--engine", "reduced", "--runs", "4", "--steps", "20000",
            "--eta", "0.02", "--checkpoints", "20", "--spacing", "linear",
            "--no-finite-d-theory"]
    res = _loradyn(tmp_path, *args, "--out", "a.h5",
                   env={"LORADYN_PROGRESS_INTERVAL": "0", "LORADYN_SEGMENT_STEPS": "2000"})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("SGD (exact chain):")]
    assert len(lines) >= 5 and "20000/20000" in lines[-1].replace(".0k", "000"), res.stderr
    res = _loradyn(tmp_path, *args, "--out", "b.h5",
                   env={"LORADYN_SEGMENT_STEPS": "2000",
                        "LORADYN_TEST_INTERRUPT_AFTER_CHUNKS": "3",
                        "LORADYN_TEST_INTERRUPT_SIGNAL": "TERM"})
    assert res.returncode == 143, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert re.match(r"interrupted \(SIGTERM\) at step 6000 of 20000: checkpoints up to step "
                    r"5263 written to b\.h5, marked interrupted", last), last
    from sims.io.trajectory import read_trajectory

    part, meta = read_trajectory(tmp_path / "b.h5")
    whole, _ = read_trajectory(tmp_path / "a.h5")
    assert meta["interrupted"] and meta["interrupted_at_step"] == 6000
    n = part.steps.size
    np.testing.assert_array_equal(part.steps, whole.steps[:n])
    np.testing.assert_array_equal(part.overlap, whole.overlap[:, :n])


# ---------------------------------------------------------------- the CUDA kernels
def cuda_segments_agree() -> dict:
    """{kernel: segmented == one call} for the numba-cuda kernels of the rank-1 chain
    (unprojected, joint ĉ, b = 2, label noise) and of the network chain (wide rows: the fused
    pass's example drawn ahead crosses the segment ends); state and records compared."""
    import torch

    from dynamics.reduced.network_simulate import ChainStart, NetworkRun
    from dynamics.reduced.params import pack_instances
    from dynamics.reduced.simulate import RankOneRun, RankOneSetup, _initial_state
    from dynamics.runtime.trajectory import checkpoint_steps

    def rank_one():
        cfg = RunConfig(instance={**BASE, "d": 40, "activation": "tanh", "u_alpha": 0.3},
                        eta=0.01, steps=24, runs=3, joint_c=True, project=False, batch=2,
                        label_noise=0.1, checkpoints=5, finite_d_theory=False).validate()
        inst = cfg.run_instances()
        params = pack_instances(inst)
        states, mu, nu, m0 = _initial_state(cfg, params, inst)
        return RankOneRun(RankOneSetup(cfg, params, inst, "numba-cuda", torch.device("cpu")),
                          checkpoint_steps(cfg.steps, cfg.checkpoints, cfg.spacing), states,
                          mu, nu, m0)

    def network():
        cfg = RunConfig(instance={"activation": "relu", "k": 2, "d": 200, "seed": 3},
                        learner="scratch", width=32, eta=0.002, steps=12, runs=2,
                        checkpoints=4, finite_d_theory=False).validate()
        return NetworkRun(ChainStart(cfg, cfg.run_instances()),
                          checkpoint_steps(cfg.steps, cfg.checkpoints, cfg.spacing),
                          "numba-cuda")

    out = {}
    for name, make in (("rank-1", rank_one), ("network", network)):
        runs = []
        for sizes in ([10**6], [1, 0, 5, 3]):
            run, i = make(), 0
            while not run.finished:
                run.advance(sizes[i % len(sizes)])
                i += 1
            runs.append(_state(run))
        out[name] = all(np.array_equal(runs[0][k], runs[1][k], equal_nan=True)
                        for k in runs[0])
    return out


CUDA_SCRIPT = """
import sys, warnings
warnings.simplefilter("ignore")  # uint64 wrap-around of the interpreted RNG
sys.path.insert(0, sys.argv[1])
from tests.test_chain_segments import cuda_segments_agree
print(cuda_segments_agree())
"""


def test_cuda_kernels_in_the_simulator_segment_alike():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_DISABLE_JIT="1")
    proc = subprocess.run([sys.executable, "-c", CUDA_SCRIPT, root], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "{'rank-1': True, 'network': True}"


@pytest.mark.skipif(not os.environ.get("LORADYN_TEST_CUDA"), reason="set LORADYN_TEST_CUDA=1 "
                    "on a machine with a GPU")
def test_cuda_kernels_on_the_device_segment_alike():  # pragma: no cover - needs a GPU
    assert cuda_segments_agree() == {"rank-1": True, "network": True}
