"""benchmarks/chain_audit.py itself: its options (the audits it measures are in
tests/test_chain_audit.py and docs/theory/audit.md)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch


def test_the_audit_script_refuses_cuda_without_cuda_in_one_line(capsys):
    """``benchmarks/chain_audit.py --device cuda`` (the chain on a GPU, for the full and 10× d
    sizes) stops before any work, with one line, where CUDA is not available."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "chain_audit.py"
    main = runpy.run_path(str(path), run_name="chain_audit")["main"]
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--regimes", "fig5", "--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("device 'cuda' was requested but CUDA is not available "
                            "(use --device cpu or auto)")


def _script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "chain_audit.py"
    return runpy.run_path(str(path), run_name="chain_audit")


def test_a_chain_stopped_by_a_signal_is_audited_up_to_the_checkpoints_it_reached(
        tmp_path, monkeypatch, capsys):
    """A signal during the chain (the one ``--chain-seconds`` sends itself; here the engine's
    test hook sends it after the third segment, whatever the machine's speed) stops the chain
    at the checkpoints reached: the record says where, and every line is audited over those
    checkpoints only — the time limit of a long audit still leaves a record."""
    import json

    from dynamics.engines import engine

    # the hook counts the segments run in this process: from 0 here, whatever ran before
    monkeypatch.setattr(engine, "_CHUNKS", [0])
    monkeypatch.setenv(engine.TEST_INTERRUPT_ENV, "3")  # past the first (short) segments
    out = tmp_path / "audit.json"
    _script()["main"](["--quick", "--regimes", "fig5", "--runs", "8", "--shared-instance",
                       "--line-budget", "1", "--json", str(out)])
    rec = json.loads(out.read_text())[0]
    assert 0 < rec["reached_step"] < rec["steps"]
    assert rec["lines"] and all(row["at_step"] <= rec["reached_step"] for row in rec["lines"])
    assert rec["chain_seconds"] > 0 and rec["lines_seconds"] > 0
    assert f"stopped at step {rec['reached_step']} of {rec['steps']}" in capsys.readouterr().out


def test_the_chain_time_limit_sends_the_stop_signal_inside_interruptible():
    """``_stop_after(s)`` sends SIGINT after s seconds: inside ``interruptible`` that only sets
    the flag the chain polls between segments (nothing is raised); None sends nothing."""
    import signal
    import time

    from dynamics.engines.engine import interruptible

    stop_after = _script()["_stop_after"]
    with interruptible(keep=True) as flag, stop_after(0.01):
        deadline = time.monotonic() + 30.0
        while flag.signum is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert flag.signum == signal.SIGINT
    with interruptible(keep=True) as flag, stop_after(None):
        time.sleep(0.05)
    assert flag.signum is None


def test_the_chain_time_limit_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        _script()["main"](["--quick", "--regimes", "fig5", "--chain-seconds", "0"])
    assert exc.value.code == 2
    assert "--chain-seconds must be > 0, got 0" in capsys.readouterr().err


def test_shards_of_other_seeds_pool_into_one_audit_of_all_their_runs(tmp_path, monkeypatch,
                                                                      capsys):
    """``--arrays`` saves the audited arrays of a run; ``--pool`` audits the runs of several
    (other seeds, e.g. parallel processes) as one: one shard alone gives back its own audit,
    two give the paired statistic of their concatenated runs (recomputed here with numpy over
    the common checkpoints), and a repeated seed or another regime is refused in one line."""
    import json

    import numpy as np

    from dynamics.engines import engine

    monkeypatch.setenv(engine.TEST_INTERRUPT_ENV, "3")  # a short chain, whatever the speed
    main = _script()["main"]
    records = []
    for seed in (0, 1):
        monkeypatch.setattr(engine, "_CHUNKS", [0])  # the hook counts from 0 in each run
        out = tmp_path / f"s{seed}.json"
        main(["--quick", "--regimes", "fig5", "--runs", "8", "--shared-instance", "--seed",
              str(seed), "--line-budget", "1", "--arrays", str(tmp_path), "--json", str(out)])
        records.append(json.loads(out.read_text())[0])
    shards = [str(tmp_path / f"fig5-seed{s}.npz") for s in (0, 1)]
    alone = tmp_path / "alone.json"
    main(["--pool", shards[0], "--json", str(alone)])
    assert json.loads(alone.read_text())[0]["lines"] == records[0]["lines"]

    both = tmp_path / "both.json"
    main(["--pool", *shards, "--json", str(both)])
    pooled = json.loads(both.read_text())[0]
    assert pooled["runs"] == 16 and pooled["shards"] == 2 and pooled["seed"] == [0, 1]
    files = []
    for path in shards:
        with np.load(path) as f:
            files.append({key: f[key] for key in f.files})
    count = min(f["steps"].size for f in files)
    assert pooled["reached_step"] == int(files[0]["steps"][count - 1])
    row = next(r for r in pooled["lines"] if r["line"] == "ode")
    x = np.concatenate([np.abs(f["x:ode"][:, :count]) for f in files])
    theory = np.concatenate([np.abs(f["theory:ode"][:, :count]) for f in files])
    assert row["runs"] == 16
    assert row["max_abs"] == pytest.approx(np.abs((x - theory).mean(axis=0)).max(), rel=1e-12)

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--pool", shards[0], shards[0]])
    assert exc.value.code == 2
    assert "--pool: shards of the same seed would repeat runs: seeds [0, 0]" in \
        capsys.readouterr().err
