"""Progress of long jobs on stderr: a live tqdm bar (with its ETA) on a terminal, and where
stderr is not one (a batch job, ``nohup``, a notebook's log) one plain line about every
``LINE_INTERVAL`` seconds, so that a log shows how far a job is and how long it has left.
A job that ends before the first interval prints nothing."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

__all__ = ["progress_bar", "warmed_up", "LINE_INTERVAL"]

# seconds between two progress lines when stderr is not a terminal (environment override)
LINE_INTERVAL = float(os.environ.get("LORADYN_PROGRESS_INTERVAL", "30"))


class _LineProgress(tqdm):
    """tqdm writing whole lines (no carriage returns), at most one per ``mininterval``."""

    def __init__(self, *args, **kwargs):
        self._lines, self._opening = 0, True
        super().__init__(*args, **kwargs)
        self._opening = False

    def display(self, msg=None, pos=None):
        if self._opening:  # the bar's opening refresh: nothing done yet
            return True
        self.fp.write((msg or self.__str__()) + "\n")
        self.fp.flush()
        self._lines += 1
        return True

    def close(self):
        if self.disable:
            return
        if self._lines:  # a closing line with the totals; a short job prints none
            self.fp.write(self.__str__() + "\n")
            self.fp.flush()
        self.disable = True  # tqdm's own close would add a blank line or a carriage return
        self._decr_instances(self)


def progress_bar(total, *, enabled: bool = True, desc: str | None = None, unit: str = "it",
                 initial: int = 0, file=None, interval: float | None = None) -> tqdm:
    """A progress bar over ``total`` units on ``file`` (stderr): a tqdm bar on a terminal,
    else a line every ``interval`` (``LINE_INTERVAL``) seconds; silent unless ``enabled``."""
    file = sys.stderr if file is None else file
    isatty = getattr(file, "isatty", lambda: False)()
    if isatty:
        return tqdm(total=total, disable=not enabled, desc=desc, unit=unit, file=file,
                    initial=initial, unit_scale=total is not None and total >= 10**4)
    return _LineProgress(total=total, disable=not enabled, desc=desc, unit=unit, file=file,
                         initial=initial,
                         mininterval=LINE_INTERVAL if interval is None else interval,
                         miniters=1, unit_scale=total is not None and total >= 10**4,
                         ascii=True)


def warmed_up(bar: tqdm, units: int) -> None:
    """Count ``units`` done in a warm-up (a kernel's compile with its first steps) without
    their time, so that the rate and ETA of the lines that follow are those of the work
    after it (the elapsed time shown starts again there)."""
    if bar.disable:
        return
    bar.unpause()  # tqdm: the timer restarts from now (nothing printed yet)
    bar.n += units
    bar.last_print_n = bar.n
