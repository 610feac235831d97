"""Sweep files: a base run configuration and the axes to vary (``docs/sweeps.md``).

A sweep file (TOML) has a ``[base]`` table of run-config fields with a ``[base.instance]``
table (or a path to an instance spec file), an ``[axes]`` table (axis name → list of values)
and optionally ``[[cases]]`` (an explicit list of partial settings, one more dimension of the
grid) and ``[sweep]`` (name, exact first-passage levels). The cells are the Cartesian product
of the axes (in file order) and the cases; each resolves to a validated
:class:`~dynamics.setup.config.RunConfig` and a content hash that identifies its results.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import tomllib
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from dynamics.instances.instance import SPEC_KEYS, load_spec
from dynamics.learners import get_learner
from dynamics.learners.options import all_options
from dynamics.setup.config import RunConfig

__all__ = [
    "SweepSpecError",
    "SweepSpec",
    "Cell",
    "INSTANCE_AXES",
    "CONFIG_AXES",
    "AXES",
    "load_sweep",
    "parse_sweep",
]

SWEEP_FORMAT_VERSION = 1  # part of every cell hash: bump when a cell's meaning changes
# axis name → instance spec key ("instance_seed" is the instance's own seed)
INSTANCE_AXES = {k: k for k in SPEC_KEYS if k not in ("seed", "gram")} | {"instance_seed": "seed"}
# the shared run fields, then every learner's options (a cell's learner must take the ones it sets)
_CONFIG_FIELDS = tuple(f for f in RunConfig.__dataclass_fields__
                       if f not in ("instance", "xi_values", "options", "extra")) \
    + tuple(all_options())
# η = eta_times_d / d^a, steps = steps_per_d · d^e, with a = eta_d_exponent and
# e = steps_d_exponent (both 1 unless given; an exponent needs its base key)
DERIVED = ("eta_times_d", "steps_per_d", "eta_d_exponent", "steps_d_exponent")
CONFIG_AXES = _CONFIG_FIELDS + DERIVED
AXES = tuple(INSTANCE_AXES) + CONFIG_AXES
BOOL_FIELDS = ("joint_c", "project")
DEFAULT_ENGINE = "auto"  # of new sweep files; files written before 2026-11-27 (whose stored
# sweep has no ``default_engine``) keep "full", the default then, so their cell hashes hold
SWEEP_KEYS = ("name", "first_passage", "absolute", "trajectory", "first_passage_of")
PASSAGE_QUANTITIES = ("overlap", "loss")  # first_passage_of: overlap ≥ level, loss ≤ level
TOP_KEYS = ("sweep", "base", "axes", "cases")
# pairs that say the same thing two ways
EXCLUSIVE = (("eta", "eta_times_d"), ("steps", "steps_per_d"), ("eta", "eta_d_exponent"),
             ("steps", "steps_d_exponent"))


class SweepSpecError(ValueError):
    """A malformed or self-contradictory sweep file (one-line message naming the problem)."""


@dataclass(frozen=True)
class Cell:
    """One cell of the grid.

    index : position in the grid (row-major over the axes, then cases); name ``cell_0007``.
    axes : the values this cell sets (axis name → value), including the case's keys.
    config : its validated RunConfig. first_passage : exact first-passage levels to record.
    hash : sha256 of the resolved config (identifies finished results on resume).
    trajectory : False = no trajectory, only the first passages (each run stops at its hit
    of each level; the cell stores the initial state as its one checkpoint).
    first_passage_of : ``overlap`` (first step with overlap ≥ level) or ``loss`` (first step
    with exact population loss ≤ level).
    """

    index: int
    axes: dict
    config: RunConfig
    first_passage: tuple
    absolute: bool
    hash: str
    trajectory: bool = True
    first_passage_of: str = "overlap"

    def passage_key(self, level: float) -> str:
        """The ``extra`` name of a level's exact first passages in this cell's trajectory."""
        return passage_key(level, self.first_passage_of)

    @property
    def name(self) -> str:
        return f"cell_{self.index:04d}"

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in self.axes.items())


@dataclass
class SweepSpec:
    """A parsed sweep file: see the module docstring and ``docs/sweeps.md``."""

    base: dict
    instance: dict
    axes: dict
    cases: list = field(default_factory=list)
    name: str = "sweep"
    first_passage: tuple = ()
    absolute: bool = True
    source: str = ""
    trajectory: bool = True
    first_passage_of: str = "overlap"
    default_engine: str = DEFAULT_ENGINE  # a cell's engine when [base]/axes/cases name none

    def to_dict(self) -> dict:
        return {"name": self.name, "base": self.base, "instance": self.instance,
                "axes": self.axes, "cases": self.cases,
                "first_passage": list(self.first_passage), "absolute": self.absolute,
                "trajectory": self.trajectory, "first_passage_of": self.first_passage_of,
                "default_engine": self.default_engine}

    def dimensions(self) -> dict:
        """Axis name → list of values, with the cases as one dimension named ``case``."""
        dims = dict(self.axes)
        if self.cases:
            dims["case"] = [_case_label(c) for c in self.cases]
        return dims

    def cells(self) -> list[Cell]:
        """Every cell of the grid, resolved and validated (SweepSpecError naming the cell)."""
        names = list(self.axes)
        cases = self.cases or [{}]
        out = []
        for i, (values, case) in enumerate(itertools.product(
                itertools.product(*(self.axes[n] for n in names)), cases)):
            setting = dict(zip(names, values, strict=True)) | case
            out.append(self._cell(i, setting))
        return out

    def _cell(self, index: int, setting: dict) -> Cell:
        cfg, inst = {"engine": self.default_engine} | self.base, dict(self.instance)
        for name, value in setting.items():
            if name in INSTANCE_AXES:
                inst[INSTANCE_AXES[name]] = value
            else:
                cfg[name] = value
        where = f"sweep cell {index} ({', '.join(f'{k}={_fmt(v)}' for k, v in setting.items())})"
        try:
            config = resolve_config(cfg, inst)
        except ValueError as exc:
            raise SweepSpecError(f"{where}: {exc}") from None
        if not self.trajectory:
            self._reduced_chain(config, where, "trajectory = false", start=True)
        if self.first_passage_of != "overlap":
            self._check_quantity(config, where)
        digest = cell_hash(config, self.first_passage, self.absolute, self.trajectory,
                           self.first_passage_of)
        return Cell(index, setting, config, self.first_passage, self.absolute, digest,
                    self.trajectory, self.first_passage_of)

    def _check_quantity(self, config: RunConfig, where: str) -> None:
        """SweepSpecError unless the cell's exact chain times ``first_passage_of``."""
        what = f"first_passage_of = {self.first_passage_of!r}"
        chain = self._reduced_chain(config, where, what)
        ok, why = chain.quantity_supported(config, self.first_passage_of)
        if not ok:
            raise SweepSpecError(f"{where}: {what}: {why}")

    @staticmethod
    def _reduced_chain(config: RunConfig, where: str, what: str, start: bool = False):
        """The cell's exact chain, or SweepSpecError "``what`` needs the reduced engine" with
        the reason where the cell does not run on one (engine "full", or no exact chain for
        its setting: what engine "auto" chooses by); ``start``: the chain must also record the
        runs' start alone (a cell without a trajectory)."""
        from dynamics.learners import get_learner
        from dynamics.reduced import reduced_supported

        ok, why = reduced_supported(config)
        chain = get_learner(config.learner).exact_chain() if ok else None
        if config.engine == "full" or not ok or (start and not chain.records_start):
            also = (" and an exact chain that records the start alone (finetune, scratch, "
                    "scratch-csq, sparse)") if start else ""
            raise SweepSpecError(f"{where}: {what} needs the reduced engine{also} "
                                 f"({why or 'engine ' + repr(config.engine)})")
        return chain


def passage_key(level: float, quantity: str = "overlap") -> str:
    """``first_passage_<level>`` (overlap) or ``first_passage_loss_<level>``."""
    return f"first_passage_{level:g}" if quantity == "overlap" else \
        f"first_passage_{quantity}_{level:g}"


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _case_label(case: dict) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in case.items())


def resolve_config(cfg: dict, inst: dict) -> RunConfig:
    """RunConfig from run fields (with eta_times_d/steps_per_d and their d-exponents, see
    ``DERIVED``) and an instance spec."""
    cfg = dict(cfg)
    d = inst.get("d")
    for derived, expo_key, target in (("eta_times_d", "eta_d_exponent", "eta"),
                                      ("steps_per_d", "steps_d_exponent", "steps")):
        expo = cfg.pop(expo_key, 1)
        if not _is_number(expo):
            raise ValueError(f"'{expo_key}' must be a finite number, got {expo!r}")
        if expo != 1 and derived not in cfg:
            raise ValueError(f"'{expo_key}' needs '{derived}'")
        if derived in cfg:
            scale = cfg.pop(derived)
            if not _is_number(scale) or scale <= 0:
                raise ValueError(f"'{derived}' must be a number > 0, got {scale!r}")
            if not isinstance(d, int) or isinstance(d, bool):
                raise ValueError(f"'{derived}' needs the instance key 'd' (an integer)")
            power = d if expo == 1 else float(d) ** expo  # exponent 1: bit-identical to before
            cfg[target] = scale / power if target == "eta" else max(1, round(scale * power))
    for name in ("eta", "steps"):
        if name not in cfg:
            raise ValueError(f"give '{name}' or '{name}_{'times' if name == 'eta' else 'per'}_d'"
                             " in [base], [axes] or [[cases]]")
    for name in BOOL_FIELDS:
        if name in cfg and not isinstance(cfg[name], bool):
            raise ValueError(f"run config: '{name}' must be true or false, got {cfg[name]!r}")
    if isinstance(cfg.get("eta"), int) and not isinstance(cfg["eta"], bool):
        cfg["eta"] = float(cfg["eta"])
    return RunConfig(instance=inst, **cfg).validate()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _defaults() -> dict:
    """Default of every key of ``RunConfig.to_dict()``: shared fields and learner options."""
    out = {}
    for name, f in RunConfig.__dataclass_fields__.items():
        if name == "options":
            continue
        if f.default is not MISSING:
            out[name] = f.default
        elif f.default_factory is not MISSING:
            out[name] = f.default_factory()
    return out | {name: spec.default for name, spec in all_options().items()}


def cell_hash(config: RunConfig, first_passage=(), absolute=True, trajectory=True,
              first_passage_of: str = "overlap") -> str:
    """sha256 of the resolved cell: format version, the config's fields and learner options
    that differ from their defaults (so a loradyn that adds a field or an option keeps
    finished cells), the sha256 of an ``init_rows`` file, the first-passage levels, and
    ``trajectory`` when False, ``first_passage_of`` when not ``overlap``."""
    defaults = _defaults()
    data = {k: v for k, v in config.to_dict().items()
            if k not in defaults or v != defaults[k]}
    rows = get_learner(config.learner).given_rows(config)
    if rows is not None:  # the rows' content, not only their path
        data["init_rows_sha256"] = rows.sha256
    cell = {"format_version": SWEEP_FORMAT_VERSION, "config": data,
            "first_passage": [float(x) for x in first_passage], "absolute": bool(absolute)}
    if not trajectory:
        cell["trajectory"] = False
    if first_passage_of != "overlap":
        cell["first_passage_of"] = first_passage_of
    blob = json.dumps(cell, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------- parsing
def load_sweep(path) -> SweepSpec:
    """Read and check a sweep TOML file (SweepSpecError with a one-line reason)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SweepSpecError(f"no such sweep file: {path}") from None
    except OSError as exc:
        raise SweepSpecError(f"cannot read sweep file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepSpecError(f"sweep file {path} is not valid TOML ({exc})") from None
    return parse_sweep(data, source=path)


def parse_sweep(data: dict, source=None) -> SweepSpec:
    """Check a sweep dict (as read from TOML) and return the :class:`SweepSpec`."""
    where = f"sweep file {source}" if source else "sweep"
    try:
        spec = _parse(data, Path(source).parent if source else Path("."))
    except SweepSpecError as exc:
        raise SweepSpecError(f"{where}: {exc}") from None
    spec.source = str(source or "")
    return spec


def _parse(data: dict, root: Path) -> SweepSpec:
    _known(data, TOP_KEYS, "top-level table")
    meta = _table(data, "sweep")
    _known(meta, SWEEP_KEYS, "[sweep] key")
    base = _table(data, "base")
    instance = _instance(base.pop("instance", None), root)
    if "xi_values" in base:
        raise SweepSpecError("'xi_values' is not allowed in [base]; sweep ξ with [axes] xi")
    _known(base, CONFIG_AXES, "[base] key")
    axes = _axes(_table(data, "axes"))
    cases = _cases(data.get("cases", []))
    if not axes and not cases:
        raise SweepSpecError("empty grid: [axes] names no axis and there are no [[cases]]")
    _check_conflicts(base, instance, axes, cases)
    _relative_to(root, base, axes, cases)
    levels = meta.get("first_passage", [])
    if not isinstance(levels, list) or not all(_is_number(x) for x in levels):
        raise SweepSpecError("[sweep] first_passage must be a list of numbers")
    absolute = meta.get("absolute", True)
    if not isinstance(absolute, bool):
        raise SweepSpecError("[sweep] absolute must be true or false")
    trajectory = meta.get("trajectory", True)
    if not isinstance(trajectory, bool):
        raise SweepSpecError("[sweep] trajectory must be true or false")
    if not trajectory and not levels:
        raise SweepSpecError("[sweep] trajectory = false records only first passages: "
                             "give first_passage levels")
    quantity = meta.get("first_passage_of", "overlap")
    if quantity not in PASSAGE_QUANTITIES:
        raise SweepSpecError(f"[sweep] first_passage_of must be one of "
                             f"{', '.join(PASSAGE_QUANTITIES)}, got {quantity!r}")
    if quantity != "overlap" and not levels:
        raise SweepSpecError(f"[sweep] first_passage_of = {quantity!r} needs first_passage "
                             "levels")
    name = meta.get("name", "sweep")
    if not isinstance(name, str):
        raise SweepSpecError("[sweep] name must be a string")
    return SweepSpec(base, instance, axes, cases, name, tuple(float(x) for x in levels),
                     absolute, trajectory=trajectory, first_passage_of=quantity)


PATH_KEYS = ("init_rows",)  # option values that name files: relative to the sweep file


def _relative_to(root: Path, base: dict, axes: dict, cases: list) -> None:
    """Paths in ``PATH_KEYS`` of [base], [axes] and [[cases]] resolved against ``root`` (the
    sweep file's folder), like ``instance = "spec.toml"``; in place."""
    def resolve(value):
        if isinstance(value, str) and not Path(value).is_absolute():
            return str(root / value)
        return value

    for key in PATH_KEYS:
        for table in (base, *cases):
            if key in table:
                table[key] = resolve(table[key])
        if key in axes:
            axes[key] = [resolve(v) for v in axes[key]]


def _table(data: dict, key: str) -> dict:
    val = data.get(key, {})
    if not isinstance(val, dict):
        raise SweepSpecError(f"'{key}' must be a table")
    return dict(val)


def _known(table: dict, valid, what: str) -> None:
    unknown = [k for k in table if k not in valid]
    if unknown:
        raise SweepSpecError(f"unknown {what} '{unknown[0]}'; valid: {', '.join(valid)}")


def _instance(value, root: Path) -> dict:
    if value is None:
        raise SweepSpecError("[base.instance] is required (a table of instance keys or a path)")
    if isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else root / value
        try:
            return load_spec(path)
        except ValueError as exc:
            raise SweepSpecError(f"[base] instance: {exc}") from None
    if not isinstance(value, dict):
        raise SweepSpecError("[base.instance] must be a table or a path to a spec file")
    bad = [k for k in value if k not in SPEC_KEYS]
    if bad:
        raise SweepSpecError(f"unknown [base.instance] key '{bad[0]}'; valid: "
                             f"{', '.join(SPEC_KEYS)}")
    return dict(value)


def _axes(table: dict) -> dict:
    for name, values in table.items():
        if name not in AXES:
            raise SweepSpecError(f"unknown axis '{name}'; valid axes: {', '.join(AXES)}")
        if not isinstance(values, list):
            raise SweepSpecError(f"axis '{name}' must be a list of values, got {values!r}")
        if not values:
            raise SweepSpecError(f"empty grid: axis '{name}' has no values")
        keys = [json.dumps(v, sort_keys=True) for v in values]
        if len(set(keys)) != len(keys):
            raise SweepSpecError(f"axis '{name}' repeats a value")
    return table


def _cases(cases) -> list:
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
        raise SweepSpecError("[[cases]] must be an array of tables")
    for i, case in enumerate(cases):
        if not case:
            raise SweepSpecError(f"case {i} is empty")
        for name in case:
            if name not in AXES:
                raise SweepSpecError(f"case {i}: unknown key '{name}'; valid: {', '.join(AXES)}")
    keys = [json.dumps(c, sort_keys=True) for c in cases]
    if len(set(keys)) != len(keys):
        raise SweepSpecError("two [[cases]] are identical")
    return [dict(c) for c in cases]


def _check_conflicts(base: dict, instance: dict, axes: dict, cases: list) -> None:
    """An axis or case key also fixed in [base] must list the base value among its values
    (it is then redundant); the pairs of EXCLUSIVE never mix."""
    fixed = dict(base) | {a: instance[k] for a, k in INSTANCE_AXES.items() if k in instance}
    for name, values in axes.items():
        if name in fixed and fixed[name] not in values:
            table = "[base.instance]" if name in INSTANCE_AXES else "[base]"
            raise SweepSpecError(f"axis '{name}' is also fixed in {table} as {fixed[name]!r}, "
                                 f"which is not among its values {values}; remove one")
    case_keys = list(dict.fromkeys(k for c in cases for k in c))
    for name in case_keys:
        if name in axes:
            raise SweepSpecError(f"'{name}' is both an axis and a [[cases]] key")
        values = [c[name] for c in cases if name in c]
        if name in fixed and fixed[name] not in values:
            raise SweepSpecError(f"[[cases]] key '{name}' is also fixed in [base] as "
                                 f"{fixed[name]!r}, which no case uses; remove one")
    present = set(fixed) | set(axes) | set(case_keys)
    for a, b in EXCLUSIVE:
        if a in present and b in present:
            raise SweepSpecError(f"'{a}' and '{b}' are both given; use one")
