"""Shared fixtures: small instance specs, per-dtype tolerances, devices (cuda only if present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import TINY_SPEC_TOML

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: one torch thread each,
    import numba  # and one numba thread (the runs' blocks, dynamics.runtime.run_threads)

    torch.set_num_threads(1)
    numba.set_num_threads(1)

# one table of tolerances per dtype (relative), used by the engine tests
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=sorted(TOLERANCE))
def dtype_tol(request) -> tuple[str, float]:
    """(dtype name, relative tolerance of invariants in that dtype)."""
    return request.param, TOLERANCE[request.param]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def small_spec() -> dict:
    """A small projected instance: ReLU, k = 3, d = 16, ξ = 1, orthonormal W."""
    return {"activation": "relu", "k": 3, "d": 16, "xi": 1.0, "seed": 9}


@pytest.fixture
def spec_dir(tmp_path, monkeypatch) -> Path:
    """A fresh working directory holding spec.toml (``helpers.TINY_SPEC_TOML``)."""
    monkeypatch.chdir(tmp_path)
    Path("spec.toml").write_text(TINY_SPEC_TOML)
    return tmp_path


@pytest.fixture
def runner(spec_dir) -> CliRunner:
    """A CliRunner working in ``spec_dir``."""
    return CliRunner()


# The quick set for development: `python -m pytest -m "not slow"` skips these (the statistical
# and end-to-end tests that took over ~10 s each when last measured, with the tests marked
# ``slow`` in their files); the whole suite stays the README's test command and CI's.
SLOW = (
    "tests/test_claim2_benchmark.py::test_table_over_d",
    "tests/test_claim2_theory.py::test_second_order_first_passage_and_probe_match_committee_ode",
    "tests/test_claim2_theory.py::test_stuck_at_a_stable_spurious_fixed_point",
    "tests/test_cli_finite_d.py::test_hermite_ode_corrected_and_step_size",
    "tests/test_committee_engine.py::test_sgd_mean_tracks_the_ode_and_the_gap_shrinks_with_d",
    "tests/test_committee_free_rows.py::test_nn2pp_mapping_is_exact",
    "tests/test_committee_free_rows.py::test_sgd_order_parameters_track_the_ode",
    "tests/test_committee_free_rows.py::test_sgd_tracks_the_committee_ode_and_concentrates_as_d_grows",
    "tests/test_committee_theory.py::test_euler_map_reproduces_nn2pp_outputs",
    "tests/test_engine_invariants.py::test_per_run_instances_and_xi_values",
    "tests/test_engine_invariants.py::test_unit_norm_and_subspace_after_1e4_steps",
    "tests/test_engine_theory.py::test_mean_overlap_follows_population_ode",
    "tests/test_finite_d_sgd.py::test_corrected_ode_tracks_sgd_mean_plain_rejected",
    "tests/test_finite_d_sgd.py::test_noise_floor_two_step_sizes",
    "tests/test_interrupt.py::test_interrupted_run_writes_the_checkpoints_reached",
    "tests/test_interrupt.py::test_interrupted_sweep_keeps_cells_and_names_the_resume_command",
    "tests/test_interrupt.py::test_sweep_interrupted_from_outside",
    "tests/test_learner_house.py::test_loradyn_run_builds_each_instance_once_and_validates_once",
    "tests/test_learner_house.py::test_the_trajectory_carries_its_instances",
    "tests/test_learner_lora.py::test_frames_stay_orthonormal_and_perpendicular",
    "tests/test_learner_lora.py::test_matrix_ode_tracks_sgd",
    "tests/test_learner_network.py::test_batch_of_runs_equals_single_runs",
    "tests/test_learner_network.py::test_engine_learns_an_easy_instance",
    "tests/test_learner_network.py::test_scratch_reaches_near_zero_loss_with_trained_second_layer",
    "tests/test_linearized_overlay.py::test_rank_one_records_the_mean_drift_ode_from_each_start",
    "tests/test_reduced_cuda_sim.py::test_cuda_kernel_in_simulator_equals_cpu_kernel",
    "tests/test_reduced_engine.py::test_initial_law_is_uniform_on_the_sphere_of_span_w_perp",
    "tests/test_reduced_law.py::test_numba_and_torch_backends_agree_in_law",
    "tests/test_reduced_law.py::test_reduced_matches_full_engine_in_law",
    "tests/test_reduced_ode.py::test_mean_overlap_tracks_population_ode_at_d_1e6",
    "tests/test_reduced_rank.py::test_reduced_rank_engine_has_the_law_of_the_full_learner",
    "tests/test_reduced_rank.py::test_reduced_rank_law_test_has_power",
    "tests/test_reproduce.py::test_reproduce_writes_h5_png_and_readme_section",
    "tests/test_run_overrides.py::test_overrides_change_the_run_and_the_stored_config",
    "tests/test_safety.py::test_huge_request_is_refused_before_allocating",
    "tests/test_scaling.py::test_scaling_cli_table_file_plot_and_expect_slope",
    "tests/test_sweep_cli.py::test_exact_first_passage_is_split_per_cell_of_a_batch",
    "tests/test_sweep_dask.py::test_local_cluster_matches_in_process",
    "tests/test_sweep_kill.py::test_sigkill_at_random_times_then_resume",
)


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`SLOW` ``slow``; a listed test that no longer exists is an
    error (the list cannot rot)."""
    seen = set()
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        if base in SLOW:
            item.add_marker(pytest.mark.slow)
            seen.add(base)
    whole = not config.args or all(arg.rstrip("/").endswith("tests") for arg in config.args)
    missing = set(SLOW) - seen
    if whole and missing and not config.getoption("-k") and not config.getoption("-m"):
        raise pytest.UsageError(f"conftest SLOW lists tests that do not exist: {sorted(missing)}")
