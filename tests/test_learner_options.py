"""Learner options: each learner owns its options (``dynamics.learners.options``); a foreign
option is a one-line error; the ``loradyn run`` flags are made from the declarations; the stored
config holds the learner's own options and old flat configs still read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from dynamics.learners import get_learner
from dynamics.learners.options import all_options, option_specs
from dynamics.setup.config import LEARNERS, ConfigError, ForeignOptionError, RunConfig
from sims.cli import cli
from sims.commands.learner_flags import flag_name
from sims.commands.run import run as run_command
from sims.experiments.sweep_spec import SweepSpecError, parse_sweep

SPEC = {"activation": "relu", "k": 3, "d": 20, "xi": 1.0, "seed": 1}


def _own(learner) -> tuple:
    return tuple(s.name for s in option_specs(get_learner(learner).Options))


def _other_value(spec):
    """A valid value of the option other than its default."""
    if spec.kind is bool:
        return not spec.default
    if spec.choices is not None:
        return next(c for c in spec.choices if c != spec.default)
    if spec.kind is int:
        return 2 if spec.default in (None, 1) else spec.default + 1
    if spec.check == "activation":
        return "tanh"
    if spec.kind is str:
        return "rows.npy"
    return 0.5


FOREIGN = [(learner, name) for learner in LEARNERS for name in all_options()
           if name not in _own(learner)]


def test_every_learner_declares_its_options():
    assert _own("finetune") == ("eta_c", "joint_c", "project", "init", "prox", "refit",
                                "refit_samples")
    assert set(_own("lora")) >= {"rank", "retraction", "joint_c"}
    assert _own("glm") == ("init",) and _own("moment") == ("moment_order",)
    assert _own("scratch-csq") == ("rows", "init_scale", "init_rows", "init_frame")
    assert _own("sparse") == ("sparse_rows", "sparse_select")
    assert {n for lrn in LEARNERS for n in _own(lrn)} == set(all_options())
    for spec in all_options().values():
        assert spec.help and spec.learners


@pytest.mark.parametrize("learner", LEARNERS)
def test_a_foreign_option_is_a_one_line_error(learner):
    names = [n for lrn, n in FOREIGN if lrn == learner]
    assert names
    own = ", ".join(_own(learner)) or "none"
    for name in names:
        with pytest.raises(ForeignOptionError) as err:
            RunConfig(instance=SPEC, learner=learner,
                      **{name: _other_value(all_options()[name])})
        assert str(err.value) == (f"run config: learner {learner!r} takes no option {name!r} "
                                  f"(its options: {own})")
        assert err.value.field == name and isinstance(err.value, ConfigError)


@pytest.mark.parametrize("learner", LEARNERS)
def test_own_options_are_kept_and_foreign_defaults_dropped(learner):
    own = {n: _other_value(all_options()[n]) for n in _own(learner)}
    foreign_defaults = {n: all_options()[n].default for lrn, n in FOREIGN if lrn == learner}
    cfg = RunConfig(instance=SPEC, learner=learner, **own, **foreign_defaults)
    assert isinstance(cfg.options, get_learner(learner).Options)
    assert dataclasses.asdict(cfg.options) == {n: own[n] for n in _own(learner)}
    for name in foreign_defaults:  # dropped: neither on the options nor flat
        assert not hasattr(cfg.options, name) and not hasattr(cfg, name)


def test_bad_option_values_name_the_option():
    for kw, message in ((dict(learner="lora", rank=0), "'rank': must be a positive integer"),
                        (dict(prox=-1.0), "'prox': must be a finite number ≥ 0"),
                        (dict(eta_c=0.0), "'eta_c': must be a finite number > 0"),
                        (dict(init="nope"), "'init': must be one of uniform, aligned"),
                        (dict(joint_c="yes"), "'joint_c': must be true or false"),
                        (dict(learner="moment", moment_order=3), "'moment_order'")):
        with pytest.raises(ConfigError, match=message) as err:
            RunConfig(instance=SPEC, **kw)
        assert "\n" not in str(err.value)


def test_options_read_typed_and_are_replaced_not_set():
    cfg = RunConfig(instance=SPEC, learner="lora", rank=2, joint_c=True)
    o = cfg.options
    assert (o.rank, o.joint_c, cfg.step_size_c) == (2, True, cfg.eta)
    with pytest.raises(AttributeError):  # no flat reading: options belong to the learner
        _ = cfg.rank
    with pytest.raises(AttributeError):
        _ = cfg.options.full_rank  # linearized's option, not lora's
    with pytest.raises(AttributeError, match="replace"):
        cfg.rank = 3
    with pytest.raises(AttributeError):
        _ = cfg.no_such_field
    assert dataclasses.replace(cfg, rank=3).options.rank == 3
    # switching learners carries the shared options and drops foreign ones left at default
    ft = dataclasses.replace(dataclasses.replace(cfg, rank=1), learner="finetune")
    assert ft.options == get_learner("finetune").Options(joint_c=True)
    with pytest.raises(ForeignOptionError, match="'rank'"):
        dataclasses.replace(cfg, learner="finetune")
    with pytest.raises(TypeError, match="bogus"):
        RunConfig(instance=SPEC, bogus=1)


@pytest.mark.parametrize("learner", LEARNERS)
def test_to_dict_stores_own_options_flat_and_round_trips(learner):
    own = {n: _other_value(all_options()[n]) for n in _own(learner)}
    cfg = RunConfig(instance=SPEC, learner=learner, eta=0.01, **own)
    data = cfg.to_dict()
    assert "options" not in data
    assert {k: data[k] for k in own} == own
    assert not set(all_options()) - set(_own(learner)) & set(data)
    back = RunConfig.from_dict(data)
    assert back == cfg and back.to_dict() == data
    assert RunConfig(**data) == cfg


def _old_flat(**changes) -> dict:
    """A config as written before options belonged to learners: every field, flat."""
    old = dict(instance=dict(SPEC), learner="finetune", eta=1e-3, eta_c=None, steps=10_000,
               runs=8, seed=0, instance_seeds="shared", xi_values=None, joint_c=False,
               project=True, batch=1, label_noise=0.0, init="uniform", checkpoints=60,
               spacing="log", dtype="float64", device="cpu", engine="full", streams="auto",
               eval_size=20_000, finite_d_theory=True, prox=0.0, full_rank=False, width=None,
               train_second_layer=False, moment_order=1, sparse_rows=None,
               sparse_select="lambda", refit=False, refit_samples=20_000, rank=1,
               retraction="polar", extra={}, resolved_instances=[{}])
    return old | changes


def test_an_old_flat_config_reads():
    cfg = RunConfig.from_dict(_old_flat(joint_c=True, eta_c=0.01))
    assert cfg.learner == "finetune" and cfg.options.joint_c is True
    assert cfg.options.eta_c == 0.01
    assert set(cfg.to_dict()) == set(_old_flat()) - {"resolved_instances", "full_rank",
                                                     "width", "train_second_layer",
                                                     "moment_order", "sparse_rows",
                                                     "sparse_select", "rank", "retraction"}
    lora = RunConfig.from_dict(_old_flat(learner="lora", rank=2, retraction="qr"))
    assert (lora.options.rank, lora.options.retraction) == (2, "qr")
    moment = RunConfig.from_dict(_old_flat(learner="moment", moment_order=2))
    assert dataclasses.asdict(moment.options) == {"moment_order": 2}
    with pytest.raises(ForeignOptionError, match="learner 'finetune' takes no option 'rank'"):
        RunConfig.from_dict(_old_flat(rank=3))
    with pytest.raises(ConfigError, match="'bogus': unknown field"):
        RunConfig.from_dict(_old_flat(bogus=1))


# ---------------------------------------------------------------- CLI
def test_every_option_has_a_flag_with_its_help():
    params = {p.name: p for p in run_command.params}
    for name, spec in all_options().items():
        param = params[name]
        assert flag_name(name) in param.opts
        assert param.help.startswith(spec.help) and spec.learners[-1] in param.help
        assert param.default == spec.default
    for old in ("--prox", "--full-rank", "--width", "--train-second-layer", "--moment-order",
                "--sparse-rows", "--sparse-select", "--refit", "--refit-samples", "--rank",
                "--retraction", "--joint-c", "--eta-c", "--init"):
        assert any(old in p.opts for p in params.values()), old
    assert "--no-project" in params["project"].secondary_opts


@pytest.mark.parametrize("args, message", [
    (["--rank", "3"], "learner 'finetune' takes no option 'rank' (its options: eta_c, joint_c, "
                      "project, init, prox, refit, refit_samples)"),
    (["--width", "8"], "learner 'finetune' takes no option 'width'"),
    (["--rank", "1"], "learner 'finetune' takes no option 'rank'"),  # typed: even the default
    (["--learner", "glm", "--no-project"], "learner 'glm' takes no option 'project'"),
    (["--learner", "moment", "--refit"], "learner 'moment' takes no option 'refit'"),
])
def test_cli_foreign_flag_exits_1_with_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    examples = Path(__file__).resolve().parent.parent / "examples" / "quickstart.toml"
    res = CliRunner().invoke(cli, ["run", str(examples), "--out", "x.h5", *args])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and f"Error: run config: {message}" in lines[0]
    assert not Path("x.h5").exists()


# ---------------------------------------------------------------- sweeps
def _sweep(cases):
    return {"base": {"eta": 0.001, "steps": 100, "runs": 2, "instance": dict(SPEC)},
            "cases": cases}


def test_sweep_cells_keep_their_hashes():
    """Hashes computed before options belonged to learners (same cells, same digests)."""
    spec = parse_sweep(_sweep([
        {"learner": "finetune", "prox": 0.1, "refit": True, "refit_samples": 500,
         "joint_c": True, "eta_c": 0.01, "project": False, "init": "aligned"},
        {"learner": "lora", "rank": 2, "retraction": "qr", "joint_c": True},
        {"learner": "scratch", "width": 4, "train_second_layer": True, "eta_c": 0.003},
        {"learner": "sparse", "sparse_rows": 2, "sparse_select": "random"}]))
    spec.default_engine = "full"  # the default then: files of that time resume with it
    cells = spec.cells()
    assert [c.hash[:16] for c in cells] == ["bbf5279435a407dc", "6f207dc56228fd9f",
                                            "f7d8649917b8d439", "57b56feedb033979"]


def test_a_foreign_option_in_a_sweep_names_the_cell():
    with pytest.raises(SweepSpecError) as err:
        parse_sweep(_sweep([{"learner": "lora", "rank": 2}, {"learner": "finetune",
                                                              "rank": 2}])).cells()
    assert "sweep cell 1" in str(err.value) and "takes no option 'rank'" in str(err.value)
    # at its default a foreign option changes nothing: a learner axis may share a base key
    data = _sweep([])
    data["base"]["rank"] = 1
    data["axes"] = {"learner": ["finetune", "lora"]}
    del data["cases"]
    assert len(parse_sweep(data).cells()) == 2
