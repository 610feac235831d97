"""benchmarks/theorem19.py's own code: a measurement split over d and merged is the one
measurement over all d (same seeds, same first passages, same fits), older files keep their
fine-tuning series, mismatched files are refused; the committee ODE's escape series is the
library's ``committee_first_passage`` from the chain runs' own starts. The script is loaded by
path, being no module; the chains and the ODE are tested in their own files."""

from __future__ import annotations

import math
import runpy
import types
from pathlib import Path

import numpy as np
import pytest

SMALL = dict(sigma="he3", runs=4, cs=[0.1], c_ft=0.05, horizon=60.0, seed=0,
             learners=["scratch"])


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "theorem19.py"
    return types.SimpleNamespace(**runpy.run_path(str(path), run_name="theorem19"))


@pytest.fixture(scope="module")
def whole(bench):
    return bench.measure(ds=[40, 57, 80], **SMALL)


def test_merged_parts_are_the_whole_measurement(bench, whole):
    parts = [bench.measure(ds=[80], **SMALL), bench.measure(ds=[40, 57], **SMALL)]
    merged = bench.merged(parts)
    assert [r["d"] for r in merged["rows"]] == [40, 57, 80]
    assert merged["times"].keys() == whole["times"].keys()
    for key, per_d in whole["times"].items():
        np.testing.assert_array_equal(np.array(merged["times"][key], dtype=float),
                                      np.array(per_d, dtype=float))
        assert merged["fits"][key] == whole["fits"][key]
    hit = np.isfinite(np.array(whole["times"]["scratch c=0.1"], dtype=float))
    assert hit.any(), "no run reached L*: the split is not tested on first passages"


def test_files_before_the_keyed_fine_tuning_row_merge_by_their_c(bench, whole):
    old = {**whole, "rows": [{("finetune" if k.startswith("finetune") else k): v
                              for k, v in row.items()} for row in whole["rows"]]}
    merged = bench.merged([old])
    assert all("finetune c=0.05" in row for row in merged["rows"])
    assert merged["fits"]["finetune c=0.05"] == whole["fits"]["finetune c=0.05"]


def test_merge_refuses_another_horizon(bench, whole):
    with pytest.raises(ValueError, match="cannot merge"):
        bench.merged([whole, {**whole, "horizon": "3·d^2"}])


def test_ode_escapes_are_the_committee_ode_s_from_the_chain_starts(bench):
    from dynamics.overlays.committee import committee_model, committee_state
    from dynamics.reduced.network_simulate import ChainStart
    from dynamics.setup.config import RunConfig
    from hermite.committee import committee_first_passage

    d, c, horizon = 30, 0.5, 50.0
    got = bench.ode_times("he3", "scratch", d, 2, c, horizon, 0)
    config = RunConfig(instance=bench.spec_for("he3", d), learner="scratch",
                       eta=c / d ** 1.5, steps=int(horizon * d * d), runs=2, seed=0,
                       engine="reduced", finite_d_theory=False)
    start = ChainStart(config, config.run_instances())
    cross, gram = start.overlaps()
    for r in range(2):
        model = committee_model(start.instances[r], loss="squared", eta=config.eta,
                                second_order=False)
        want = committee_first_passage(model, committee_state(cross[r], gram[r],
                                                              start.lam_hat[r]),
                                       bench.target_loss("he3", d), d,
                                       alpha_max=config.steps / d, max_evals=30_000).escape
        assert (math.isnan(got[r]) and math.isinf(want)) or got[r] == want
    assert np.isfinite(got).any()
