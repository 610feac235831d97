"""``loradyn reproduce``: every recipe resolves to valid cells; a (shrunken) figure runs end to
end into HDF5, PNG and a README section; missing learners give a one-line error."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from dynamics.learners import LEARNERS  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.figures import FIGURES, fig2  # noqa: E402
from sims.reproduce import render  # noqa: E402
from sims.sweep_io import read_sweep  # noqa: E402
from sims.sweep_spec import parse_sweep  # noqa: E402

INTRO = "# results/\n\nCurated outputs; intro kept.\n"


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_recipe_resolves(name, quick):
    recipe = FIGURES[name]
    spec = parse_sweep(recipe.sweep(quick))
    if recipe.learner and recipe.learner not in LEARNERS:
        with pytest.raises(ValueError, match=f"unknown learner '{recipe.learner}'"):
            spec.cells()
        return
    cells = spec.cells()
    assert cells
    for panel in recipe.panels(quick):
        assert panel.title
    d = {c.config.instance["d"] for c in cells}
    assert max(d) <= (1000 if quick else 2000)
    if quick:  # quick budgets: total run-steps stay small
        assert sum(c.config.steps * c.config.runs for c in cells) < 6e7


def test_unit_row_convention_is_stated_in_every_caption():
    for recipe in FIGURES.values():
        assert "unit-row" in recipe.caption


@pytest.mark.skipif("linearized" in LEARNERS, reason="the linearized learner exists")
def test_fig3_without_linearized_learner_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(cli, ["reproduce", "fig3", "--quick", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: fig3 needs the learner 'linearized', which is not "
                                  f"available in this loradyn (learners: {', '.join(LEARNERS)})")
    assert list(tmp_path.iterdir()) == []


def tiny_fig2(quick: bool) -> dict:
    spec = fig2.sweep(quick)
    spec["base"] |= {"runs": 3, "steps_per_d": 20, "checkpoints": 12, "eta_times_d": 0.2}
    spec["base"]["instance"] |= {"d": 20, "k": 3}
    return spec


def test_reproduce_writes_h5_png_and_readme_section(tmp_path, monkeypatch):
    monkeypatch.setitem(FIGURES, "fig2", dataclasses.replace(FIGURES["fig2"], sweep=tiny_fig2))
    (tmp_path / "README.md").write_text(INTRO)
    args = ["reproduce", "fig2", "--quick", "--out-dir", str(tmp_path)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fig2_quick.png").stat().st_size > 1000
    meta, cells = read_sweep(tmp_path / "fig2_quick.h5")
    assert meta["complete"] and [c.axes for c in cells] == [{"joint_c": True},
                                                           {"joint_c": False}]
    text = (tmp_path / "README.md").read_text()
    assert text.startswith(INTRO)
    assert "## Figure 2 (quick)" in text and "![Figure 2 (quick)](fig2_quick.png)" in text
    assert f"loradyn reproduce fig2 --quick --out-dir {tmp_path}" in text
    assert "unit-row" in text
    res = CliRunner().invoke(cli, args, catch_exceptions=False)  # resumes, replaces section
    assert "2 finished, 0 to run" in res.output
    assert (tmp_path / "README.md").read_text().count("## Figure 2 (quick)") == 1

    fig = render(FIGURES["fig2"], tmp_path / "fig2_quick.h5", True)
    assert [ax.get_title() for ax in fig.axes] == ["(a) joint training of ĉ and û",
                                                   "(b) ĉ frozen, û trained"]
    assert fig.axes[0].get_ylabel() == "overlap |⟨û_t, u⟩|"
    assert len(fig.axes[0].get_lines()) == 3 + 1  # every run + the median
    assert any(ln.get_linestyle() == "--" for ln in fig.axes[1].get_lines())  # ODE (frozen)
    assert fig._suptitle.get_text().startswith("fig2 (quick): σ = relu, k = 3, d = 20")
    plt.close(fig)


def test_unknown_figure_is_a_usage_error():
    res = CliRunner().invoke(cli, ["reproduce", "fig9"])
    assert res.exit_code == 2 and "fig9" in res.output
