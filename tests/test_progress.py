"""Progress of long jobs where stderr is not a terminal (dynamics.runtime.progress): whole lines at
an interval, nothing for a job shorter than one interval, a live bar on a terminal."""

import io
import time

from dynamics.runtime.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run(out, steps, pause, **kw):
    with progress_bar(steps, file=out, unit="step", desc="SGD", **kw) as bar:
        for _ in range(steps):
            time.sleep(pause)
            bar.update(1)
    return out.getvalue()


def test_lines_at_the_interval_with_eta_and_no_carriage_returns():
    text = _run(io.StringIO(), 12, 0.02, interval=0.05)
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 3 <= len(lines) <= 12, lines
    assert lines[-1].startswith("SGD: 100%") and "12/12" in lines[-1]
    assert all("<" in ln for ln in lines)  # tqdm's [elapsed<remaining] (the ETA)


def test_a_job_shorter_than_one_interval_prints_nothing():
    assert _run(io.StringIO(), 5, 0.0, interval=30.0) == ""


def test_disabled_prints_nothing_and_initial_counts():
    assert _run(io.StringIO(), 5, 0.01, interval=0.0, enabled=False) == ""
    out = io.StringIO()
    with progress_bar(10, file=out, unit="cell", initial=4, interval=0.0) as bar:
        bar.update(6)
    assert out.getvalue().splitlines()[-1].split("|")[-1].strip().startswith("10/10")


def test_a_terminal_gets_tqdms_live_bar():
    text = _run(_Terminal(), 5, 0.0)
    assert "\r" in text and "5/5" in text


def test_a_run_with_stderr_in_a_file_logs_progress_lines(tmp_path):
    """`loradyn run` on the full engine, stderr redirected to a file (a batch job): progress
    lines in the file (the interval shortened through LORADYN_PROGRESS_INTERVAL)."""
    import os
    import subprocess
    import sys

    (tmp_path / "s.toml").write_text('activation = "relu"\nk = 3\nd = 200\nxi = 1.0\n')
    log = tmp_path / "err.log"
    with open(log, "w") as err:
        res = subprocess.run(
            [sys.executable, "-c", "import sys; from sims.cli import main; sys.argv[0] = "
             "'loradyn'; main()", "run", "s.toml", "--engine", "full", "--runs", "2",
             "--steps", "40000", "--eta", "0.0005", "--checkpoints", "5",
             "--no-finite-d-theory", "--out", "o.h5"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300,
            env={**os.environ, "LORADYN_PROGRESS_INTERVAL": "0.05"})
    assert res.returncode == 0, log.read_text()
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("SGD:")]
    assert len(lines) >= 3 and "40000/40000" in lines[-1].replace(".0k", "000"), lines


def test_a_warm_up_is_left_out_of_the_rate():
    """A first unit that takes 1.5 s (a kernel's compile) and 30 units of 0.01 s: after
    ``warmed_up`` the lines' rate is that of the 30 (≈ 100 step/s; without it, the first
    lines would say under 20 step/s)."""
    import re

    from dynamics.runtime.progress import warmed_up

    out = io.StringIO()
    with progress_bar(31, file=out, unit="step", desc="SGD", interval=0.05) as bar:
        time.sleep(1.5)
        warmed_up(bar, 1)
        for _ in range(30):
            time.sleep(0.01)
            bar.update(1)
    rates = [float(r) for r in re.findall(r"([\d.]+)step/s", out.getvalue())]
    assert rates and min(rates) > 25.0, out.getvalue()
    assert "31/31" in out.getvalue().splitlines()[-1]
