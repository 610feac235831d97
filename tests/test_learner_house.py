"""The learner house (issue 23): a learner's file is the one place it is described, and a run
is resolved once.

* No code outside ``dynamics/learners/`` compares a learner's name (parsed, not grepped by
  eye: every comparison and membership test in the package's source is read with ``ast``).
* The consumers ask the learner: budget, reduced engine, validation, plots, CLI defaults.
* ``loradyn run`` builds each instance once and validates once (the calls are counted).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.engines import budget
from dynamics.errors import ConfigError
from dynamics.instances import instance
from dynamics.learners import LEARNERS, get_learner
from dynamics.learners.base import FAMILIES, Learner, Memory
from dynamics.learners.registry import default_learner, learner_classes
from dynamics.reduced import reduced_supported
from dynamics.setup.config import RunConfig
from sims.cli import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dynamics", "hermite", "sims")
NAMES = set(LEARNERS)


def _strings(node) -> set[str]:
    """The string constants of a node that is a constant or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


def _mentions_teacher(node) -> bool:
    """``spec.get("teacher", "finetune") == …``: a teacher kind, not a learner name."""
    return "teacher" in ast.unparse(node)


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison of something with a learner name (==, !=, in, not
    in against a name or a collection holding one), and of every module-level tuple/list of
    two or more learner names (a second registry)."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_strings(s) & NAMES for s in sides) and not any(
                    _mentions_teacher(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            if len(_strings(node.value) & NAMES) >= 2:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_detector_finds_what_it_must():
    assert name_comparisons('if config.learner == "glm":\n    pass\n')
    assert name_comparisons('ok = learner in ("scratch", "scratch-csq")\n')
    assert name_comparisons('NETWORK = ("scratch", "scratch-csq", "sparse")\n')
    assert name_comparisons('x = "lora" != name\n')
    assert not name_comparisons('ok = inst.get("teacher", "finetune") != "committee"\n')
    assert not name_comparisons('ok = config.learner == other\n')


def test_no_learner_name_is_compared_outside_the_learners_package():
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("dynamics", "learners"):
                continue
            for line, code in name_comparisons(path.read_text()):
                offenders.append(f"{rel}:{line}: {code}")
    assert not offenders, "learner names compared outside dynamics/learners/:\n" + "\n".join(
        offenders)


@pytest.mark.parametrize("name", LEARNERS)
def test_every_learner_declares_itself(name):
    cls = get_learner(name)
    assert cls.name == name and issubclass(cls, Learner)
    assert cls.family in FAMILIES
    assert set(cls.teachers) <= set(instance.TEACHERS) and cls.teachers
    assert set(cls.conventions) <= set(instance.CONVENTIONS) and "unit" in cls.conventions
    config = RunConfig(dict(activation="relu", k=3, d=20, xi=1.0), learner=name)
    mem = cls.memory(config, 20, 3)
    assert isinstance(mem, Memory) and min(mem.state, mem.records, mem.prepared) > 0
    chain = cls.exact_chain()
    assert chain is None or callable(chain.simulate)
    assert isinstance(cls.variant(config.to_dict()), str)
    assert cls.committee_loss in (None, "squared", "correlation")
    assert (cls.committee_loss is not None) == (cls.family == "network")


def test_the_registry_answers_from_the_declarations():
    assert default_learner() == "finetune" and default_learner("committee") == "scratch"
    with pytest.raises(ValueError, match="no learner learns"):
        default_learner("nobody")
    chains = {cls.name for cls in learner_classes() if cls.exact_chain() is not None}
    assert chains == {"finetune", "glm", "linearized", "lora", "lora-ba", "pretrained-glm",
                      "scratch", "scratch-csq",
                      "sparse"}  # linearized: its full-rank parameterisation
    spec = dict(activation="relu", k=3, d=20, xi=1.0)
    ok, why = reduced_supported(RunConfig(spec, learner="moment"))
    assert not ok and "'moment' has no exact finite-state reduction" in why
    assert all(repr(n) in why for n in sorted(chains))
    # App. B conventions: who runs them comes from Learner.conventions
    with pytest.raises(ConfigError, match="supported by 'finetune' only"):
        RunConfig(dict(spec, convention="appB"), learner="lora").validate()
    with pytest.raises(ConfigError, match="learnt by learner 'scratch' or 'scratch-csq'"):
        RunConfig(dict(activation="relu", k=3, d=20, teacher="committee"),
                  learner="sparse").validate()


def test_budget_uses_the_declared_memory(monkeypatch):
    """The estimate's state part is the learner's declared state numbers, whatever learner."""
    spec = dict(activation="relu", k=3, d=40, xi=1.0)
    base = budget.estimate(RunConfig(spec, learner="glm", runs=10))

    def declared(cls, config, d, k):
        return Memory(state=1000 * d, records=1, prepared=2 * k + 4)

    monkeypatch.setattr(get_learner("glm"), "memory", classmethod(declared))
    more = budget.estimate(RunConfig(spec, learner="glm", runs=10))
    item = 8  # float64: state twice (snapshot) in the run dtype plus the float64 initial copy
    growth = more.parts["state"] - base.parts["state"]
    assert growth == 10 * (1000 * 40 - (40 + 3)) * (2 * item + 8)


def _count_calls(monkeypatch):
    """Counters of build_instance (wherever it was imported) and RunConfig.validate."""
    counts = {"build_instance": 0, "validate": 0}
    original_build = instance.build_instance
    original_validate = RunConfig.validate

    def build(*args, **kw):
        counts["build_instance"] += 1
        return original_build(*args, **kw)

    def validate(self, *args, **kw):
        counts["validate"] += 1
        return original_validate(self, *args, **kw)

    for module in list(sys.modules.values()):
        if getattr(module, "build_instance", None) is original_build:
            monkeypatch.setattr(module, "build_instance", build)
    monkeypatch.setattr(RunConfig, "validate", validate)
    return counts


@pytest.mark.parametrize("args, builds", [
    ([], 1),  # one instance for every run
    (["--engine", "reduced"], 1),
    (["--xi", "0.5", "--xi", "2"], 3),  # the spec's (for the default η), then one per ξ
    (["--xi", "1", "--xi", "2"], 2),  # the spec's own ξ = 1 is reused
    # the spec's (seed 9, also run 0's) and runs 1, 2 (seeds 10, 11)
    (["--instance-seeds", "per_run", "--runs", "3"], 3),
])
def test_loradyn_run_builds_each_instance_once_and_validates_once(tmp_path, monkeypatch, args,
                                                                   builds):
    import sims.commands.run  # noqa: F401 - load the command (and its imports) first

    counts = _count_calls(monkeypatch)
    out = tmp_path / "r.h5"
    res = CliRunner().invoke(cli, ["run", str(ROOT / "examples" / "quickstart.toml"),
                                   "--out", str(out), "--runs", "4", "--steps", "50",
                                   "--checkpoints", "5", *args])
    assert res.exit_code == 0, res.output
    assert counts == {"build_instance": builds, "validate": 1}
    from sims.io.trajectory import read_trajectory

    traj, meta = read_trajectory(out)
    assert len(meta["config"]["resolved_instances"]) == len(np.unique(traj.xi)) or \
        "per_run" in args


def test_the_trajectory_carries_its_instances():
    from dynamics.engines.engine import simulate

    config = RunConfig(dict(activation="relu", k=3, d=20, xi=1.0), runs=3, steps=20,
                       checkpoints=3, xi_values=[0.5, 1.0, 2.0])
    traj = simulate(config)
    assert [i.xi for i in traj.instances] == [0.5, 1.0, 2.0]
    reduced = simulate(RunConfig(config.instance, runs=3, steps=20, checkpoints=3,
                                 xi_values=[0.5, 1.0, 2.0], engine="reduced"))
    assert [i.xi for i in reduced.instances] == [0.5, 1.0, 2.0]
