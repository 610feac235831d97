"""``loradyn show FILE.h5``: what a trajectory file holds (provenance, config, summary)."""

from __future__ import annotations

import json

import click

from sims.commands.run import summary_json
from sims.io.trajectory import read_trajectory

__all__ = ["show", "describe"]

HEADER = ("format", "format_version", "loradyn_version", "git_commit", "created", "engine",
          "learner", "dtype", "device", "loss_kind", "seed")


def describe(path) -> dict:
    """Provenance, config, dataset shapes and summary of a trajectory file."""
    traj, meta = read_trajectory(path)
    out = {key: meta.get(key) for key in HEADER}
    out["config"] = meta.get("config")
    out["datasets"] = meta["datasets"]
    out["summary"] = traj.summary()
    return out


@click.command("show")
@click.argument("file")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def show(file, as_json):
    """Describe the trajectory FILE (.h5 written by `loradyn run`)."""
    info = describe(file)
    if as_json:
        traj, _ = read_trajectory(file)
        info["curve"] = summary_json(traj)
        click.echo(json.dumps(info, default=str))
        return
    for key in HEADER:
        click.echo(f"{key:16s} {info[key]}")
    cfg = info["config"] or {}
    spec = cfg.get("instance", {})
    click.echo(f"{'instance':16s} {json.dumps(spec, sort_keys=True)}")
    keys = ("eta", "eta_c", "steps", "runs", "batch", "label_noise", "init", "joint_c",
            "project", "xi_values", "instance_seeds")
    click.echo(f"{'run':16s} " + ", ".join(f"{k}={cfg.get(k)}" for k in keys))
    for name, shape in info["datasets"].items():
        click.echo(f"{'dataset':16s} {name} {tuple(shape)}")
    s = info["summary"]
    click.echo(f"{'summary':16s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                f"{k}={v}" for k, v in s.items()))
