"""Sweeps default to engine "auto" (issue 38.1); sweep files written before keep "full".

A cell that names no engine runs on ``auto`` in a new sweep file. A file written when the
default was ``full`` (its stored sweep has no ``default_engine``) is resumed under ``full``,
so its cell hashes — which leave out fields at their RunConfig default, engine "full" among
them — and its finished cells hold.
"""

from __future__ import annotations

import json

import h5py
from helpers import sweep_toml

from sims.experiments.sweep import adopt_file_defaults, run_sweep
from sims.experiments.sweep_spec import cell_hash, load_sweep


def _spec(tmp_path, text=None):
    path = tmp_path / "s.toml"
    path.write_text(text or sweep_toml(runs=2, steps_per_d=2, checkpoints=4))
    return load_sweep(path)


def test_cells_that_name_no_engine_run_on_auto(tmp_path):
    assert {c.config.engine for c in _spec(tmp_path).cells()} == {"auto"}
    named = _spec(tmp_path, sweep_toml(engine="full"))
    assert {c.config.engine for c in named.cells()} == {"full"}


def test_a_full_default_keeps_the_hashes_of_files_written_before(tmp_path):
    spec = _spec(tmp_path)
    spec.default_engine = "full"
    for cell in spec.cells():
        assert cell.config.engine == "full"
        # the hash of the same config with engine left at RunConfig's default ("full"), as
        # sweeps before default_engine computed it
        assert cell.hash == cell_hash(cell.config)
    assert all(c.hash != d.hash for c, d in zip(spec.cells(), _spec(tmp_path).cells(),
                                                strict=True))


def test_an_older_sweep_file_resumes_under_full_and_reuses_its_cells(tmp_path):
    out = tmp_path / "s.h5"
    old = _spec(tmp_path)
    old.default_engine = "full"
    first = run_sweep(old, out)
    assert first.computed == len(old.cells())
    with h5py.File(out, "a") as f:  # as a file written before default_engine existed
        stored = json.loads(f.attrs["sweep"])
        del stored["default_engine"]
        f.attrs["sweep"] = json.dumps(stored)
    notes = []
    again = run_sweep(_spec(tmp_path), out, echo=notes.append)
    assert (again.computed, again.reused) == (0, len(old.cells()))
    assert any("keep engine 'full'" in n for n in notes)


def test_a_new_sweep_file_records_its_default_and_resumes_with_it(tmp_path):
    out = tmp_path / "s.h5"
    run_sweep(_spec(tmp_path), out)
    with h5py.File(out, "r") as f:
        assert json.loads(f.attrs["sweep"])["default_engine"] == "auto"
    spec = _spec(tmp_path)
    assert adopt_file_defaults(spec, out) is None and spec.default_engine == "auto"
    assert run_sweep(spec, out).computed == 0
