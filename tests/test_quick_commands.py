"""Quick commands (issue 26, item 4): ``--help`` and every error found before any compute
import neither torch nor numba (checked in a fresh interpreter, no timed assertion): torch is
loaded at its first use (:mod:`dynamics.lazy`), hermite's and dynamics' names on first use
(PEP 562), numba kernels only by the modules that run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "examples" / "quickstart.toml")

PROBE = """
import atexit, json, sys
def report():
    loaded = {name: name in sys.modules for name in ("torch._C", "numba.core")}
    print("LOADED " + json.dumps(loaded), file=sys.stderr)
atexit.register(report)
from sims.cli import main
sys.argv = ["loradyn"] + sys.argv[1:]
main()
"""


def _probe(tmp_path, *args) -> tuple[int, str, dict]:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    lines = out.stderr.strip().splitlines()
    loaded = json.loads(next(ln for ln in lines if ln.startswith("LOADED "))[7:])
    errors = [ln for ln in lines if not ln.startswith("LOADED ")]
    return out.returncode, "\n".join(errors), loaded


@pytest.mark.parametrize("args, code, message", [
    (["--help"], 0, ""),
    (["run", "--help"], 0, ""),
    (["sweep", "--help"], 0, ""),
    (["hermite", "--help"], 0, ""),
    (["plot", "--help"], 0, ""),
    (["run", QUICKSTART, "--eta", "-1", "--out", "x.h5"], 1, "'eta': must be a finite number"),
    (["run", QUICKSTART, "--runs", "0", "--out", "x.h5"], 1, "'runs': must be a positive"),
    (["run", QUICKSTART, "--learner", "nope", "--out", "x.h5"], 1, "unknown learner 'nope'"),
    (["run", QUICKSTART, "--rank", "3", "--out", "x.h5"], 1, "takes no option 'rank'"),
    (["run", QUICKSTART, "--set", "xi=-1", "--out", "x.h5"], 1, "key 'xi' (--set xi)"),
    (["run", QUICKSTART, "--set", "activation=nope", "--out", "x.h5"], 1,
     "unknown activation 'nope'"),
    (["run", QUICKSTART, "--set", "k=300", "--out", "x.h5"], 1, "must be ≥ k + 2"),
    (["run", "missing.toml", "--out", "x.h5"], 1, "no such file"),
    (["run", QUICKSTART, "--out", "exists.h5"], 1, "--out exists.h5 exists"),
])
def test_help_and_precompute_errors_load_neither_torch_nor_numba(tmp_path, args, code,
                                                                 message):
    (tmp_path / "exists.h5").write_bytes(b"precious")
    rc, err, loaded = _probe(tmp_path, *args)
    assert rc == code, err
    assert message in err and (not message or len(err.splitlines()) == 1), err
    assert loaded == {"torch._C": False, "numba.core": False}, (args, loaded)
    assert (tmp_path / "exists.h5").read_bytes() == b"precious"


def test_a_run_does_load_them(tmp_path):
    """The probe itself can fail: a real run loads torch (and the theory's numba kernels)."""
    rc, err, loaded = _probe(tmp_path, "run", QUICKSTART, "--steps", "20", "--runs", "2",
                             "--checkpoints", "3", "--out", "ok.h5")
    assert rc == 0, err
    assert loaded == {"torch._C": True, "numba.core": True}


def test_lazy_import_defers_until_first_use():
    code = ("import sys; from dynamics.lazy import lazy_import, is_loaded; "
            "m = lazy_import('colorsys'); a = is_loaded('colorsys'); "
            "m.rgb_to_hsv(0.1, 0.2, 0.3); print(a, is_loaded('colorsys'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_lazy_import_never_puts_a_half_loaded_module_in_sys_modules():
    """The stand-in is not a module in sys.modules (the LazyLoader's half-executed module there
    broke torch's import on CPython >= 3.12.3); after the first use the global that held it is
    the real module."""
    code = ("import sys, types; from dynamics.lazy import lazy_import; "
            "wave = lazy_import('wave'); a = 'wave' in sys.modules; "
            "b = isinstance(wave, types.ModuleType); wave.Error; "
            "print(a, b, 'wave' in sys.modules, isinstance(wave, types.ModuleType), "
            "wave is sys.modules['wave'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["False", "False", "True", "True", "True"], out.stderr
