"""Initial first-layer rows given by the user (``scratch``/``scratch-csq`` option
``init_rows``), placed in each run's canonical frame.

The file (``.npy``, or text readable by ``numpy.loadtxt``) holds a k′×d array (every run
starts there) or an R×k′×d array (run r starts at its own rows). ``init_frame`` says in which
coordinates:

- ``original``: the coordinates of the spec's explicit W (``teacher = "committee"`` with W a
  k×d array). With W = R̃ᵀQᵀ (``scipy.linalg.qr(Wᵀ)``, Q d×k orthonormal) the canonical frame
  has vᵢ = (R̃ᵀ)ᵢ = (Lᵢ, 0, …); a row ŵ goes to (ŵQ, P-part) where the parts P = Ŵ − ŴQQᵀ
  orthogonal to span W are embedded isometrically in coordinates k, k+1, … (an SVD
  P = U S Vᵀ gives coordinates U S). Every inner product ⟨vᵢ, ŵⱼ⟩ and ⟨ŵⱼ, ŵₗ⟩ is kept, and
  x ~ N(0, I_d) is isotropic, so the run has the law it would have in W's coordinates
  (docs/theory/committee-engine.md, "Given initial rows").
- ``canonical``: already in the canonical frame (``dynamics.instances.instance``): coordinates 0…k−1
  span the teacher's W with vᵢ = (Lᵢ, 0, …) (L = Cholesky factor of the Gram, or the
  identity for ``W = "orthonormal"``), coordinate k is u's direction orthogonal to span W (a
  fine-tuned teacher), the rest the complement.
- ``auto`` (default): ``original`` when the spec gives W explicitly for a committee teacher,
  else ``canonical``.

Free rows are used as they are; unit rows are normalised onto the sphere (a zero row is an
error). The file's sha256 is recorded in the trajectory for provenance.
"""

from __future__ import annotations

import hashlib
import io
from functools import lru_cache
from pathlib import Path

import numpy as np
import scipy.linalg as sla

from dynamics.errors import ConfigError

__all__ = ["INIT_FRAMES", "GivenRows", "given_rows", "resolve_frame", "canonical_rows",
           "given_rows_attrs", "check_given_rows"]

INIT_FRAMES = ("auto", "original", "canonical")


class GivenRows:
    """The rows of an ``init_rows`` file: ``array`` (read-only, float64, k′×d or R×k′×d),
    ``path`` (as given), ``sha256`` of the file's bytes."""

    def __init__(self, path: str, array: np.ndarray, sha256: str):
        self.path, self.array, self.sha256 = path, array, sha256

    @property
    def width(self) -> int:
        """k′, the number of rows."""
        return int(self.array.shape[-2])

    @property
    def per_run(self) -> bool:
        """Whether each run has its own rows (an R×k′×d array)."""
        return self.array.ndim == 3

    def for_run(self, r: int) -> np.ndarray:
        """Run r's rows (k′×d)."""
        return self.array[r] if self.per_run else self.array


def _problem(path: str, what: str) -> ConfigError:
    return ConfigError("init_rows", f"{path}: {what}")


@lru_cache(maxsize=2)  # check, width and start read it once per run
def _read(resolved: str, mtime_ns: int, size: int) -> tuple[np.ndarray | None, str, str | None]:
    """(read-only float64 array, sha256 of the bytes, problem or None): the file is read and
    checked once per version (path, mtime, size)."""
    data = Path(resolved).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        if resolved.endswith(".npy"):
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        else:
            arr = np.loadtxt(io.StringIO(data.decode()), ndmin=2)
        arr = np.array(arr, dtype=np.float64)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, digest, (f"cannot read rows ({reason}); expected a .npy file or a text "
                              "table of k′×d numbers")
    if arr.ndim not in (2, 3) or 0 in arr.shape:
        return None, digest, f"must hold a k′×d or R×k′×d array, got shape {arr.shape}"
    if not np.isfinite(arr).all():
        return None, digest, "holds NaN or infinite entries"
    arr.setflags(write=False)
    return arr, digest, None


def given_rows(path: str) -> GivenRows:
    """Read and check an ``init_rows`` file (ConfigError naming the problem in one line)."""
    p = Path(path)
    if not p.is_file():
        raise _problem(path, "no such file" if not p.exists() else "not a file")
    try:
        st = p.stat()
        arr, digest, problem = _read(str(p.resolve()), st.st_mtime_ns, st.st_size)
    except OSError as exc:
        raise _problem(path, f"cannot read rows ({exc.strerror or exc})") from None
    if problem is not None:
        raise _problem(path, problem)
    return GivenRows(path, arr, digest)


def given_rows_attrs(rows: GivenRows, frame: str) -> dict:
    """Provenance of a run's given rows (as read when the run started), written as
    attributes of ``extra/alignment``: ``init_rows`` (the path as given),
    ``init_rows_sha256``, ``init_rows_shape`` and ``init_frame`` (original or canonical)."""
    return {"init_rows": rows.path, "init_rows_sha256": rows.sha256,
            "init_rows_shape": list(rows.array.shape), "init_frame": frame}


def resolve_frame(frame: str, instance) -> str:
    """``original`` or ``canonical`` for option ``init_frame`` and the run's instance."""
    explicit = instance.committee and instance.spec.get("W") == "explicit"
    if frame == "auto":
        return "original" if explicit else "canonical"
    if frame == "original" and not explicit:
        why = ("a fine-tuned teacher's u is given only by u_alpha, not in coordinates"
               if not instance.committee else f"its W is {instance.spec.get('W')!r}")
        raise ConfigError("init_frame", f"'original' needs the teacher's rows in coordinates "
                                        f"(teacher = 'committee' with an explicit k×d W); "
                                        f"{why}: give the rows in the canonical frame "
                                        f"(--init-frame canonical)")
    return frame


def check_given_rows(rows: GivenRows, instance, runs: int, unit: bool) -> None:
    """Shape against (R, d) and, for unit rows, no zero row (ConfigError)."""
    d = instance.d
    if rows.array.shape[-1] != d:
        raise _problem(rows.path, f"rows have {rows.array.shape[-1]} coordinates but d = {d}")
    if rows.per_run and rows.array.shape[0] != runs:
        raise _problem(rows.path, f"an R×k′×d array needs R = runs = {runs}, got "
                                  f"{rows.array.shape[0]}")
    if unit and (np.linalg.norm(rows.array, axis=-1) == 0).any():
        raise _problem(rows.path, "a zero row cannot be put on the sphere (rows unit)")


def canonical_rows(rows: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """``rows`` (k′×d) in the canonical frame (module docstring): ``w`` is the spec's explicit
    k×d W for rows in its coordinates (``original``), None for rows already canonical
    (returned as a float64 copy)."""
    rows = np.array(rows, dtype=np.float64)
    if w is None:
        return rows
    w = np.asarray(w, dtype=np.float64)
    k, d = w.shape
    q, _ = sla.qr(w.T, mode="economic")  # W = R̃ᵀQᵀ: the instance's factor is R̃ᵀ
    inside = rows @ q  # (k′, k) coordinates in span W
    resid = rows - inside @ q.T  # parts orthogonal to span W
    u, s, _ = np.linalg.svd(resid, full_matrices=False)
    m = min(len(s), d - k)  # the residuals live in d − k dimensions
    out = np.zeros((rows.shape[0], d))
    out[:, :k] = inside
    out[:, k:k + m] = u[:, :m] * s[:m]
    return out
