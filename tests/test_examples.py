"""Every sweep and scaling file under examples/ parses and resolves all its cells (a file a
reader copies from the docs must not fail on a renamed key or a bad value)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sims.experiments.scaling import load_scaling
from sims.experiments.sweep_spec import load_sweep

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = sorted(p for p in EXAMPLES.glob("*.toml") if p.name.startswith(("scaling", "sweep")))


def test_the_examples_are_there():
    assert len(FILES) >= 10 and (EXAMPLES / "scaling_theorem19_he3.toml") in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_resolves_every_cell(path):
    if path.name.startswith("scaling"):
        spec = load_scaling(path)
        cells = spec.sweep.cells()
        assert [c.config.instance["d"] for c in cells] == spec.d
    else:
        cells = load_sweep(path).cells()
    assert cells and all(c.config.runs >= 1 for c in cells)
