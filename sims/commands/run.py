"""``loradyn run SPEC``: simulate R runs of online SGD and write one HDF5 trajectory file.

SPEC may carry a ``[run]`` table of run options (:data:`RUN_KEYS`: ``learner``, ``eta``,
``steps``, ``runs``, ``batch``, … and every learner option such as ``mu``): they are the
defaults of this file's runs; a flag typed on the command line wins over them.

``--set KEY=VALUE`` (repeatable) overrides one key of SPEC before anything is built
(:func:`parse_overrides`: the value is read as a TOML/JSON scalar or array, a bare word as a
string; an unknown key or a malformed pair is a one-line error naming it): an instance key
(``--set d=4000``), else a run key of the ``[run]`` table (``--set mu=0.7``); ``run.KEY``
names a run key explicitly (``--set run.seed=3``: ``seed`` alone is the instance's). A run
key given both by ``--set`` and by its flag is refused (one line).

Interruption (issue 26; :func:`dynamics.engines.engine.interruptible`): the first SIGINT (Ctrl-C) or
SIGTERM stops the full engine at its next chunk end, the reduced engine at its next segment
end (about half a second); the checkpoints reached so far are written to --out as a
complete, checksummed trajectory file marked ``interrupted`` (``loradyn show`` says so), the
run's state to its resume file, one line says where, and the command exits 130 (SIGINT) or
143 (SIGTERM). A second signal aborts at once and writes nothing. An existing --out is never
replaced without --force (checked before any compute).

Resume files (issue 37.3; :mod:`sims.io.resume`): every few minutes of wall time
(``LORADYN_RESUME_SECONDS``, default 300) and when a signal stops it, the run saves its
state beside --out as ``OUT.resume`` (atomically, fsynced); a finished run removes it. After
a kill (``kill -9``, the machine going down) or a signal, the same command plus ``--resume``
continues from it to the numbers an uninterrupted run gives (bit for bit). ``--resume``
without a resume file, or with one whose config, fingerprint of the inputs or engine differs
from the command's, is one line naming the difference, and nothing is changed. A command
without ``--resume`` whose --out has a resume file is refused (one line) unless ``--force``,
which starts over.

Outputs (issue 37): --out and --plot are locked for the whole command (a second ``loradyn``
writing either is refused at once, naming the holder's pid; :mod:`sims.io.lock`), the
trajectory file's size (runs × checkpoints × datasets) is checked against the free space of
its filesystem before the compute, and an OS error while writing (no space, permission,
read-only filesystem, quota, I/O error) is one line naming the file, an earlier file kept
(:mod:`sims.io.atomic`).
"""

from __future__ import annotations

import json
import math
import tomllib
import warnings
from dataclasses import dataclass, field, replace

import click
import numpy as np
from click.core import ParameterSource

from dynamics.engines.choice import engine_reason
from dynamics.engines.engine import interruptible, simulate
from dynamics.instances.instance import (
    RUN_TABLE,
    SPEC_KEYS,
    SpecError,
    build_instance,
    load_spec,
    read_spec_file,
)
from dynamics.learners import get_learner
from dynamics.learners.options import all_options
from dynamics.learners.registry import default_learner
from dynamics.overlays.audit import audit_trajectory
from dynamics.runtime.resume import Checkpointer
from dynamics.setup.config import ENGINES, LEARNERS, STREAMS, RunConfig
from dynamics.setup.defaults import (
    ETA_C,
    FALLBACK_PER_D,
    default_eta,
    default_steps,
    has_population_ode,
)
from sims.commands.checks import (
    blowup_lines,
    check_run_space,
    claim_run_outputs,
    health,
    health_text,
    memory_guard,
    preflight,
    warn,
)
from sims.commands.learner_flags import flag_name, given_options, learner_flags
from sims.io.resume import fingerprint, load_resume, read_resume, resume_path, write_resume
from sims.io.summary import quantity_summaries
from sims.io.trajectory import write_trajectory
from sims.plots.quick import instance_title, plot_run

__all__ = ["run", "RunRequest", "run_config", "summary_json", "parse_overrides",
           "apply_overrides", "RUN_KEYS", "run_keys", "check_run_table"]

_QUOTED = ('"', "'", "[", "{")  # a value starting so must parse as TOML/JSON


def _parse_value(key: str, text: str):
    """A ``--set`` value: TOML, else JSON, else (a bare word such as ``tanh`` or
    ``erf(x/sqrt2)``) the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        pass
    if not text.strip() or text.lstrip().startswith(_QUOTED):
        raise ValueError(f"--set {key}={text}: the value is not a TOML/JSON scalar or array")
    return text.strip()


#: the run options a spec's ``[run]`` table (and ``--set``) may give, besides the learner
#: options: the learner and the RunConfig fields the command sets (RunRequest.config_fields)
RUN_KEYS = ("learner", "eta", "steps", "runs", "seed", "batch", "label_noise", "checkpoints",
            "spacing", "xi_values", "instance_seeds", "dtype", "device", "engine", "streams",
            "finite_d_theory")
_RUN_PREFIX = f"{RUN_TABLE}."


def run_keys() -> tuple[str, ...]:
    """Every key of a ``[run]`` table: :data:`RUN_KEYS`, then every learner option."""
    return (*RUN_KEYS, *all_options())


def parse_overrides(pairs) -> tuple[dict, dict]:
    """``("KEY=VALUE", …)`` → ({instance key: value}, {run key: value}) (module docstring);
    a malformed pair (ValueError) or an unknown key (SpecError, as the spec parser words it,
    naming ``--set KEY``) is one line."""
    instance, run = {}, {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE (e.g. --set d=4000)")
        name = key.removeprefix(_RUN_PREFIX)
        if key in SPEC_KEYS:
            instance[key] = _parse_value(key, text)
        elif name in run_keys():
            run[name] = _parse_value(key, text)
        else:
            err = SpecError(key, "")
            err.args = (f"instance spec: key '{key}' (--set {key}): unknown key; valid keys: "
                        f"{', '.join(SPEC_KEYS)}; run keys ([run], or run.KEY): "
                        f"{', '.join(run_keys())}",)
            raise err
    return instance, run


def check_run_table(table: dict, path) -> dict:
    """The ``[run]`` table of spec ``path``, its keys checked (an unknown one is a one-line
    SpecError naming it); the values are checked by the config they build."""
    for key in table:
        if key not in run_keys():
            err = SpecError(key, "")
            err.args = (f"instance spec {path}: [run] key '{key}': unknown key; valid keys: "
                        f"{', '.join(run_keys())}",)
            raise err
    return table


def apply_overrides(spec: dict, overrides: dict) -> dict:
    """The spec dict with ``overrides`` applied (a new dict)."""
    return {**spec, **overrides}


def _name_override(exc: SpecError, overrides: dict) -> None:
    """Re-raise a spec error about an overridden key naming its ``--set``."""
    key = getattr(exc, "key", None)
    if key in overrides:
        text = str(exc).replace(f"key '{key}'", f"key '{key}' (--set {key})", 1)
        err = SpecError(key, "")
        err.args = (text,)
        raise err from None


def run_config(spec_path, *, eta, steps, spec: dict | None = None, built=None,
               **options) -> tuple[RunConfig, list[str]]:
    """Build the RunConfig (validated by :func:`dynamics.engines.resolve.resolve_run`, in the
    pre-flight checks); ``eta``/``steps`` None → defaults (noted in the list).
    ``spec``/``built``: the spec dict and its instance when the caller has them already (not
    ``base``: that is a learner option, pretrained-glm's)."""
    spec = load_spec(spec_path) if spec is None else spec
    base = build_instance(spec) if built is None else built
    if base.d is None:
        raise ValueError(f"instance spec {spec_path}: key 'd' is required to simulate")
    # the shared fields first, cheaply: a bad option is refused before any default is computed
    RunConfig(instance=spec, eta=1.0 if eta is None else eta,
              steps=1 if steps is None else steps, **options).check_fields()
    notes = []
    if eta is None:
        eta = default_eta(base)
        if get_learner(options.get("learner", default_learner())).takes_step_size:
            notes.append(f"η = {eta * base.d:.3g}/d = {eta:.3g} (default)")
    if steps is None:
        steps = default_steps(base, eta)
        source = ("from the population ODE" if has_population_ode(base) else
                  f"{FALLBACK_PER_D}·d: no population ODE of m for this instance")
        notes.append(f"steps = {steps} (default, {source})")
    return RunConfig(instance=spec, eta=eta, steps=steps, **options), notes


def spec_learner(spec: dict) -> str:
    """The learner of a run without ``--learner``: the first that learns the spec's teacher
    (``registry.default_learner``: finetune; scratch for a committee teacher); an unknown
    teacher gives the default (validation then names it)."""
    try:
        return default_learner(str(spec.get("teacher", "finetune")))
    except ValueError:
        return default_learner()


def summary_json(traj) -> dict:
    """{"steps", "overlap_mean", "overlap_std", "ode"[, "ode_corrected"]} over non-diverged
    runs (null for NaN), plus the loss and every recorded quantity's summary
    (:func:`sims.io.summary.quantity_summaries`) and, keyed by the theory dataset, the theory
    audit (``audit``: :meth:`dynamics.overlays.audit.Audit.as_json`, the numbers the file
    stores)."""
    ok = ~traj.diverged
    ov = traj.overlap[ok] if ok.any() else np.full((1, traj.steps.size), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, std = np.nanmean(ov, axis=0), np.nanstd(ov, axis=0)
        ode = np.nanmean(traj.ode, axis=0)
        corrected = (np.nanmean(traj.ode_corrected, axis=0)
                     if traj.ode_corrected is not None else None)

    def clean(a):
        return [None if not math.isfinite(v) else float(v) for v in a]

    out = {"steps": [int(s) for s in traj.steps], "overlap_mean": clean(mean),
           "overlap_std": clean(std), "ode": clean(ode)}
    if corrected is not None:
        out["ode_corrected"] = clean(corrected)
    out |= quantity_summaries(traj)  # loss and every recorded quantity (issue 18)
    out["audit"] = {name: a.as_json() for name, a in audit_trajectory(traj).items()}
    report = health(traj)  # present only when something went wrong (issue 16)
    if report["left_sphere"] or report["flat"] or report["ode_blowup"]:
        out["health"] = report
    return out


LONG_FULL_RUN = 10**10  # steps × runs × d past which a full-engine run is worth a warning


def _summary_line(traj, notes) -> str:
    s = traj.summary()
    t05 = s["median_steps_to_0.5"]
    network = "alignment" in traj.extra  # from-scratch learners: alignment and loss
    what = "alignment" if network else "overlap"
    parts = [f"runs {s['runs']} ({health_text(traj, sphere=not network)})",
             f"median {what} at step {int(traj.steps[-1])}: {s['median_final_overlap']:.4f}"
             + (f", median loss {np.nanmedian(traj.loss[:, -1]):.4g}" if network else ""),
             f"past 0.9: {100 * s['fraction_past_0.9']:.0f}%",
             "median steps to 0.5: " + (f"{t05:.0f}" if math.isfinite(t05) else "not reached")
             + (f" ({100 * s['fraction_reached_0.5']:.0f}% reached it)"
                if s["fraction_reached_0.5"] < 1 else "")]
    return "; ".join(notes + parts)


def _audit_lines(traj) -> list[str]:
    """One line per theory line: its audit against the SGD mean (issue 40; the numbers the
    file stores, :mod:`dynamics.overlays.audit`)."""
    hidden = {line for line, attrs in traj.extra_attrs.items() if "not_drawn" in attrs}
    return [audit.text() + ("; not drawn in the plot (another line of its quantity is within)"
                            if line.removeprefix("extra/") in hidden else "")
            for line, audit in audit_trajectory(traj).items()]


@dataclass(frozen=True)
class RunRequest:
    """The options of one ``loradyn run``: its click parameters, the learner flags gathered
    in ``learner_options`` (name → value, given or not). ``given``/``given_run``: the
    ``--set`` overrides of instance and run keys, parsed (:func:`parse_overrides`) when the
    request is made; ``table_options``: learner options from the spec's ``[run]`` table and
    ``--set`` (:meth:`with_run_table`)."""

    spec: str
    out: str
    learner: str | None
    eta: float | None
    steps: int | None
    runs: int
    seed: int
    batch: int
    label_noise: float
    checkpoints: int
    spacing: str
    xi_values: tuple[float, ...]
    instance_seeds: str
    dtype: str
    device: str
    engine: str
    streams: str
    overrides: tuple[str, ...]
    plot: str | None
    force: bool
    finite_d_theory: bool
    as_json: bool
    resume: bool
    learner_options: dict
    table_options: dict = field(default_factory=dict)
    given: dict = field(init=False, repr=False)
    given_run: dict = field(init=False, repr=False)

    def __post_init__(self):
        instance, run_ = parse_overrides(self.overrides)
        object.__setattr__(self, "given", instance)
        object.__setattr__(self, "given_run", run_)

    def with_run_table(self, table: dict, ctx: click.Context) -> RunRequest:
        """The request with the run keys of the spec's ``[run]`` table and of ``--set`` (over
        the table) for what the command line left at its default; a key both ``--set`` and
        typed as its flag is a one-line ValueError."""
        typed = {key for key in (*RUN_KEYS, *all_options())
                 if ctx.get_parameter_source(key) not in (None, ParameterSource.DEFAULT)}
        both = sorted(typed & set(self.given_run))
        if both:
            raise ValueError(f"--set {both[0]}=… and {flag_name(both[0])} both given: "
                             "keep one")
        merged = {key: value for key, value in {**table, **self.given_run}.items()
                  if key not in typed}
        fields_ = {key: merged.pop(key) for key in RUN_KEYS if key in merged}
        if "xi_values" in fields_:
            fields_["xi_values"] = tuple(fields_["xi_values"])
        return replace(self, **fields_, table_options=merged)

    @classmethod
    def from_params(cls, params: dict) -> RunRequest:
        """The request of the command's click parameters (the learner flags among them)."""
        flags = all_options()
        return cls(**{k: v for k, v in params.items() if k not in flags},
                   learner_options={k: v for k, v in params.items() if k in flags})

    def config_fields(self) -> dict:
        """The RunConfig fields the command sets (eta/steps None: defaults, :func:`run_config`)."""
        return dict(eta=self.eta, steps=self.steps, runs=self.runs, seed=self.seed,
                    batch=self.batch, label_noise=self.label_noise,
                    checkpoints=self.checkpoints, spacing=self.spacing,
                    xi_values=list(self.xi_values) or None, instance_seeds=self.instance_seeds,
                    dtype=self.dtype, device=self.device, engine=self.engine,
                    streams=self.streams, finite_d_theory=self.finite_d_theory)


@click.command("run")
@click.argument("spec")
@click.option("--learner", default=None,
              help="Learner: finetune (rank-1 LoRA, eq. 4), lora (rank r), linearized "
                   "(NTK), scratch, scratch-csq, sparse (S²FT), glm, moment, pretrained-glm "
                   "(a pre-trained single-index base μ·u plus a·v), lora-ba (LoRA's "
                   "B·A adapter, plain SGD) [default: finetune; "
                   "scratch for a committee teacher].",
              metavar="|".join(LEARNERS))
@learner_flags
@click.option("--eta", type=float, default=None,
              help=f"Step size η [default: c/d, c ≤ {ETA_C} from the instance's noise floor].")
@click.option("--steps", type=int, default=None,
              help="SGD steps [default: from the population ODE].")
@click.option("--runs", type=int, default=64, help="Independent runs R.")
@click.option("--seed", type=int, default=0, help="Master seed.")
@click.option("--batch", type=int, default=1, help="Mini-batch size b.")
@click.option("--label-noise", type=float, default=0.0, help="Variance of label noise.")
@click.option("--checkpoints", type=int, default=60, help="Number of checkpoints.")
@click.option("--spacing", type=click.Choice(["log", "linear"]), default="log",
              help="Checkpoint spacing.")
@click.option("--xi", "xi_values", type=float, multiple=True,
              help="ξ values (repeatable; runs split evenly) [default: the spec's ξ].")
@click.option("--instance-seeds", type=click.Choice(["shared", "per_run"]), default="shared",
              help="One instance for all runs, or run r uses spec seed + r.")
@click.option("--dtype", type=click.Choice(["float64", "float32"]), default="float64",
              help="Arithmetic of the simulation.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu",
              help="auto: cuda when available.")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="auto: the exact dimension-free chain (reduced) where the learner has one "
                   "for this setting, else the full O(d) engine (the summary says which and "
                   "why); full or reduced to insist on one.")
@click.option("--streams", type=click.Choice(STREAMS), default="auto",
              help="Full engine's example streams: one generator per run (run r's numbers "
                   "independent of R) or one shared (one draw per chunk: fast on CUDA); "
                   "auto: per_run on CPU, shared on CUDA; counter (CPU): a counter-based "
                   "ziggurat per run, same law, other numbers, ~6x cheaper per number.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a key of SPEC (repeatable): an instance key (--set d=4000 --set "
                   "activation=tanh --set lam=[1,2,3]) or a run key of its [run] table "
                   "(--set mu=0.7, --set run.seed=3); values are TOML/JSON scalars or arrays.")
@click.option("--out", required=True,
              help="Output HDF5 file (written atomically; on SIGINT/SIGTERM the checkpoints "
                   "reached, marked interrupted).")
@click.option("--plot", default=None,
              help="Also write an overlap-vs-steps figure (.png, .pdf or .svg).")
@click.option("--force", is_flag=True,
              help="Replace an existing --out / --plot file (refused otherwise).")
@click.option("--finite-d-theory/--no-finite-d-theory", default=True,
              help="Also record the finite-d theory: finetune's noise-corrected ODE and band "
                   "(frozen ĉ, projected, b = 1); the committee ODE of scratch, scratch-csq "
                   "and sparse.")
@click.option("--json", "as_json", is_flag=True, help="Print the mean curve as JSON.")
@click.option("--resume", is_flag=True,
              help="Continue the unfinished run of this same command from its resume file "
                   "OUT.resume (saved every few minutes and on Ctrl-C/SIGTERM): the numbers "
                   "of an uninterrupted run; --out and --plot are then replaced. One line "
                   "and no change where there is none or it is another command's.")
def run(**params):
    """Simulate online SGD on the instance SPEC (JSON/TOML) and write --out."""
    request = RunRequest.from_params(params)  # a bad --set is named first
    # --resume replaces the interrupted run's own outputs (module docstring)
    with claim_run_outputs(request.spec, request.out, request.plot,
                           request.force or request.resume):  # before any default
        _run(request)


def _command_line() -> str | None:
    """The command line that resumes this run (``loradyn run … --resume``), where the
    process was started as ``loradyn run``."""
    import shlex
    import sys

    args = sys.argv[1:]
    if args[:1] != ["run"]:
        return None
    return shlex.join(["loradyn", *args, *([] if "--resume" in args else ["--resume"])])


def _resume_writer(path, config_text: str, fp: dict, out):
    """The checkpointer's ``write``: the resume file (:mod:`sims.io.resume`); an OS error
    (disk full, …) is one warning line, and the run goes on without it."""
    command, failed = _command_line(), []

    def write(state) -> None:
        try:
            write_resume(path, state, config=config_text, fingerprint=fp, out=out,
                         command=command)
        except OSError as exc:
            if not failed:
                warn(f"{exc}; the run goes on without a resume file")
            failed.append(exc)

    return write


def _resume_state(path, resume: bool, force: bool, config_text: str, fp: dict, engine: str):
    """The saved state to go on from (``--resume``), or None; a resume file left by an
    unfinished run is refused without --resume or --force (--force removes it)."""
    if resume:
        return load_resume(path, config=config_text, fingerprint=fp, engine=engine)
    if path.exists():
        if not force:
            try:
                saved, _ = read_resume(path, arrays=False)
                where = f" (step {saved.step} of {saved.total})"
            except ValueError:
                where = ""
            raise click.ClickException(
                f"{path} holds the state of an unfinished run of --out{where}; add --resume "
                "to continue it, or --force to start over")
        path.unlink()
    return None


def _run(request: RunRequest) -> None:
    """The body of ``loradyn run`` once its outputs are claimed (locked)."""
    spec, given, out, plot = request.spec, request.given, request.out, request.plot
    spec_dict, table = read_spec_file(spec)  # read once
    spec_dict = apply_overrides(spec_dict, given)
    ctx = click.get_current_context()
    request = request.with_run_table(check_run_table(table, spec), ctx)
    learner = request.learner or spec_learner(spec_dict)
    try:
        base = build_instance(spec_dict)  # the spec's instance, built once
        options = given_options(ctx, request.learner_options, learner,
                                table=request.table_options)
        config, notes = run_config(spec, spec=spec_dict, built=base, learner=learner,
                                   **request.config_fields(), **options)
        resolved = preflight(config, instance=base)  # validated there, before any compute
    except SpecError as exc:
        _name_override(exc, given)
        raise
    check_run_space(config, out)
    engine, why = engine_reason(config)
    notes.append(f"engine {engine}" + (f" (auto: {why})" if why else ""))
    saved_at = resume_path(out)
    config_text, fp = fingerprint(config, resolved.run_instances)
    state = _resume_state(saved_at, request.resume, request.force, config_text, fp,
                          resolved.engine)
    if state is not None:
        notes.append(f"resumed at step {state.step} from {saved_at}")
    if why and config.steps * config.runs * base.d >= LONG_FULL_RUN:
        warn(f"engine auto takes the full O(d) engine for this long run ({why}); "
             "progress and ETA follow")
    checkpointer = Checkpointer(_resume_writer(saved_at, config_text, fp, out))
    with interruptible() as stop:  # module docstring
        with memory_guard():
            traj = simulate(resolved, progress=True, checkpointer=checkpointer, resume=state)
        for line in blowup_lines(health(traj)):
            warn(line)
        write_trajectory(out, traj, config,  # the instances the trajectory carries
                         interrupted_at=stop.step, interrupted_by=stop.signal_name)
        if stop.step is None:  # finished: its state is of no more use
            saved_at.unlink(missing_ok=True)
        if stop.signum is not None:
            _interrupted(stop, traj, config, out, plot, saved_at)
    if plot:
        plot_run(traj, plot, instance_title(config), config=config)
    if request.as_json:
        click.echo(json.dumps(summary_json(traj)))
    else:
        click.echo(_summary_line(traj, notes))
        for line in _audit_lines(traj):
            click.echo(line)
        click.echo(f"wrote {out}" + (f" and {plot}" if plot else ""))
    if traj.diverged.all():
        first = int(traj.diverged_step.min())
        raise click.ClickException(f"all {traj.runs} runs diverged (first at step {first}); "
                                   f"lower --eta (file written: {out})")


def _interrupted(stop, traj, config, out, plot, saved_at) -> None:
    """One line saying what was written, then exit 128 + the signal (130, 143)."""
    name = stop.signal_name
    if stop.step is not None:
        line = (f"interrupted ({name}) at step {stop.step} of {config.steps}: checkpoints up "
                f"to step {int(traj.steps[-1])} written to {out}, marked interrupted"
                + ("; --plot skipped" if plot else "")
                + (f"; the same command with --resume continues it ({saved_at})"
                   if saved_at.exists() else ""))
    else:  # in the theory or the writing after the last step
        line = (f"interrupted ({name}) after the last step: the finished run was "
                f"written to {out}" + ("; --plot skipped" if plot else ""))
    click.echo(line, err=True)
    click.get_current_context().exit(128 + int(stop.signum))
