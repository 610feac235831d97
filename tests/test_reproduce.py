"""``loradyn reproduce``: every recipe resolves to valid cells; a (shrunken) figure runs end to
end into HDF5, PNG and a README section; missing learners give a one-line error;
``--convention appB|appB-sqrt`` sets the instance key in every cell, suffixes the files, has
its own README section and caption, draws no theory line and refuses fig3 (linearized)."""

from __future__ import annotations

import dataclasses
import math

import matplotlib
from helpers import shrunk_sweep

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from dynamics.learners import LEARNERS  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.commands import reproduce as reproduce_cmd  # noqa: E402
from sims.experiments.figures import FIGURES, fig2  # noqa: E402
from sims.experiments.figures.recipe import convention_caption, with_convention  # noqa: E402
from sims.experiments.reproduce import check_convention, figure_paths, render, update_readme  # noqa: E402
from sims.experiments.sweep_spec import parse_sweep  # noqa: E402
from sims.io.sweep import read_sweep  # noqa: E402

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


tiny_fig2 = shrunk_sweep(fig2.sweep, runs=3, steps_per_d=20, checkpoints=12, eta_times_d=0.2)


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
    # every run + the median + the population ODE (joint ĉ: hermite.finetune.population)
    # + its finite-d corrected form (dash-dotted)
    assert len(fig.axes[0].get_lines()) == 3 + 3
    assert sum(ln.get_linestyle() == "-." for ln in fig.axes[0].get_lines()) == 1
    assert any(ln.get_linestyle() == "--" for ln in fig.axes[1].get_lines())  # ODE (frozen)
    assert fig._suptitle.get_text().startswith("fig2 (quick): σ = relu, k = 3, d = 20")
    plt.close(fig)


def test_unknown_figure_is_a_usage_error():
    res = CliRunner().invoke(cli, ["reproduce", "fig9"])
    assert res.exit_code == 2 and "fig9" in res.output


# ---------------------------------------------------------------- --convention (App. B model)
APPB = ("appB", "appB-sqrt")


@pytest.mark.parametrize("convention", APPB)
@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("name", sorted(set(FIGURES) - {"fig3"}))
def test_convention_is_set_in_every_cell(name, quick, convention):
    recipe = FIGURES[name]
    unit = parse_sweep(recipe.sweep(quick)).cells()
    cells = parse_sweep(with_convention(recipe.sweep(quick), convention)).cells()
    assert len(cells) == len(unit)
    for cell, ref in zip(cells, unit, strict=True):
        assert cell.config.instance["convention"] == convention
        assert "convention" not in ref.config.instance
        # the same cell otherwise: only the instance key differs
        assert cell.config.instance == ref.config.instance | {"convention": convention}
        assert (cell.config.eta, cell.config.steps, cell.config.runs) == (
            ref.config.eta, ref.config.steps, ref.config.runs)
    inst = cells[0].config.run_instances()[0]
    s = inst.k / (inst.k + inst.xi ** 2)  # App. B's row factor, as printed or its root
    assert inst.row_scale == pytest.approx(s if convention == "appB" else math.sqrt(s))
    assert inst.output_scale == pytest.approx(1 / inst.xi)


def test_unit_convention_leaves_the_sweep_and_file_names_unchanged(tmp_path):
    for recipe in FIGURES.values():
        assert with_convention(recipe.sweep(True), "unit") == recipe.sweep(True)
        assert convention_caption(recipe.caption, "unit") == recipe.caption
    assert figure_paths("fig2", True, tmp_path) == (tmp_path / "fig2_quick.h5",
                                                    tmp_path / "fig2_quick.png")
    assert figure_paths("fig2", False, tmp_path, "appB") == (tmp_path / "fig2_appB.h5",
                                                            tmp_path / "fig2_appB.png")
    assert figure_paths("fig6", True, tmp_path, "appB-sqrt")[1].name == (
        "fig6_quick_appB-sqrt.png")
    with pytest.raises(ValueError, match="unknown convention 'appC'"):
        figure_paths("fig2", True, tmp_path, "appC")


@pytest.mark.parametrize("convention", APPB)
def test_fig3_under_appB_is_a_one_line_error(tmp_path, convention):
    args = ["reproduce", "fig2", "fig3", "--quick", "--out-dir", str(tmp_path),
            "--convention", convention]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1
    assert res.output.strip() == (f"Error: fig3 needs the learner 'linearized', which the "
                                  f"App. B convention '{convention}' does not support (it "
                                  "runs 'finetune' only)")
    assert list(tmp_path.iterdir()) == []  # refused before fig2 ran


def test_all_under_appB_skips_fig3_with_a_note(monkeypatch, tmp_path):
    ran = []

    def fake(name, **kwargs):
        ran.append((name, kwargs["convention"]))
        raise ValueError("stop here")

    monkeypatch.setattr(reproduce_cmd, "run_figure", fake)
    res = CliRunner().invoke(cli, ["reproduce", "all", "--quick", "--convention", "appB",
                                   "--out-dir", str(tmp_path)])
    assert "skipping fig3: fig3 needs the learner 'linearized'" in res.output
    assert ran == [("fig1", "appB")] and res.exit_code == 1
    assert check_convention(FIGURES["fig3"], "unit") is None


def test_appB_caption_replaces_the_convention_sentence():
    for recipe in FIGURES.values():
        for convention in APPB:
            text = convention_caption(recipe.caption, convention)
            assert "unit-row" not in text and text.startswith(recipe.caption[:40])
            assert f"convention = {convention}" in text
            assert "plain O(η) population ODE of these rows" in text
        assert "vᵢ = k/(k+ξ²)·(wᵢ + ξcᵢu)" in convention_caption(recipe.caption, "appB")
        assert "√(k/(k+ξ²))" in convention_caption(recipe.caption, "appB-sqrt")


def test_reproduce_appB_writes_suffixed_files_and_its_own_readme_section(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setitem(FIGURES, "fig2", dataclasses.replace(FIGURES["fig2"], sweep=tiny_fig2))
    tail = "\n<!-- scaling -->\n## Other results\n\nkept.\n"
    (tmp_path / "README.md").write_text(INTRO)
    unit = ["reproduce", "fig2", "--quick", "--out-dir", str(tmp_path)]
    appb = unit + ["--convention", "appB"]
    assert CliRunner().invoke(cli, unit, catch_exceptions=False).exit_code == 0
    with open(tmp_path / "README.md", "a") as fh:  # other results after the figure sections
        fh.write(tail)
    res = CliRunner().invoke(cli, appb, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert f"wrote {tmp_path / 'fig2_quick_appB.h5'}" in res.output
    assert (tmp_path / "fig2_quick_appB.png").stat().st_size > 1000
    assert (tmp_path / "fig2_quick.png").exists()  # the unit figure is kept

    meta, cells = read_sweep(tmp_path / "fig2_quick_appB.h5")
    assert meta["complete"] and len(cells) == 2
    for cell in cells:
        assert cell.config["instance"]["convention"] == "appB"
        assert np.isfinite(cell.traj.ode).all()  # the plain O(η) ODE covers App. B rows
        assert np.isfinite(cell.traj.overlap).all() and np.isfinite(cell.traj.loss).all()
    _, unit_cells = read_sweep(tmp_path / "fig2_quick.h5")
    # a different model: the step-0 Monte Carlo losses of the same instances differ
    assert not np.allclose(cells[0].traj.loss[:, 0], unit_cells[0].traj.loss[:, 0])

    text = (tmp_path / "README.md").read_text()
    assert text.startswith(INTRO) and text.endswith(tail)
    assert text.count("## Figure 2 (quick)\n") == 1  # the unit section stays
    title = "Figure 2 (quick, App. B convention appB)"
    section = text[text.index("<!-- reproduce:fig2-quick-appB -->"):
                   text.index("<!-- /reproduce:fig2-quick-appB -->")]
    assert text.index("<!-- /reproduce:fig2-quick -->") < text.index(section) < text.index(
        "<!-- scaling -->")  # after the figure sections, before the rest
    assert f"## {title}\n\n![{title}](fig2_quick_appB.png)" in section
    assert f"loradyn reproduce fig2 --quick --out-dir {tmp_path} --convention appB" in section
    assert "unit-row" not in section and "vᵢ = k/(k+ξ²)·(wᵢ + ξcᵢu)" in section
    assert "`fig2_quick_appB.h5`" in section
    res = CliRunner().invoke(cli, appb, catch_exceptions=False)  # resumes, replaces section
    assert "2 finished, 0 to run" in res.output
    again = (tmp_path / "README.md").read_text()
    assert again.count(f"## {title}") == 1 and again.count("## Figure 2 (quick)\n") == 1

    fig = render(FIGURES["fig2"], tmp_path / "fig2_quick_appB.h5", True)
    assert fig._suptitle.get_text().startswith(
        "fig2 (quick, App. B convention appB): σ = relu, k = 3, d = 20")
    # every run + the median + the plain O(η) ODE and its finite-d corrected form (App. B
    # rows: hermite.finetune.population)
    assert len(fig.axes[0].get_lines()) == 3 + 3
    assert any(ln.get_linestyle() == "--" for ax in fig.axes for ln in ax.get_lines())
    plt.close(fig)
    with pytest.raises(ValueError, match="use convention 'appB', not 'unit'"):
        render(FIGURES["fig2"], tmp_path / "fig2_quick_appB.h5", True, "unit")


def test_readme_sections_are_kept_in_order(tmp_path):
    (tmp_path / "README.md").write_text(INTRO)
    update_readme(tmp_path, FIGURES["fig5"], True, tmp_path / "fig5_quick_appB.png", "cmd",
                  "1 s", "appB")
    with open(tmp_path / "README.md", "a") as fh:  # other results after the figure sections
        fh.write("\n<!-- scaling -->\nother\n")
    for name, quick, convention in [("fig2", True, "unit"),
                                    ("fig6", True, "unit"), ("fig2", True, "appB-sqrt"),
                                    ("fig2", True, "appB"), ("fig4", False, "appB"),
                                    ("fig5", True, "appB")]:
        png = figure_paths(name, quick, tmp_path, convention)[1]
        update_readme(tmp_path, FIGURES[name], quick, png, f"cmd {name}", "1 s", convention)
    text = (tmp_path / "README.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["## Figure 2 (quick)", "## Figure 6 (quick)",
                     "## Figure 4 (App. B convention appB)",
                     "## Figure 2 (quick, App. B convention appB)",
                     "## Figure 5 (quick, App. B convention appB)",
                     "## Figure 2 (quick, App. B convention appB-sqrt)"]
    assert text.startswith(INTRO) and text.endswith("\n<!-- scaling -->\nother\n")
    assert "\n\n\n" not in text


def test_help_lists_every_target_with_what_it_draws():
    out = CliRunner().invoke(cli, ["reproduce", "--help"]).output
    for name, recipe in FIGURES.items():
        assert recipe.summary and f"{name}  {recipe.summary}" in out, name
