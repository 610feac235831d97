"""Problem instances (W, λ, c, ĉ, u, ξ, σ) and the instance specification file.

The teacher is f*(x) = Σᵢ λᵢ σ(⟨vᵢ, x⟩) with vᵢ = (wᵢ + ξ cᵢ u)/Nᵢ, Nᵢ = ‖wᵢ + ξ cᵢ u‖
(paper §1.1, eq. 3, rows renormalized); the student replaces (c, u) by (ĉ, û).

Rotation invariance (docs/model.md, "Canonical frame"): x ~ N(0, I_d) is isotropic, so an
instance is stored in its *canonical frame*: coordinates 0..k-1 span span(W), coordinate k is
the unit direction e of u's part orthogonal to span(W), the rest is the complement. In that
frame W = [L, 0] with L the k×k factor (L Lᵀ = G = W Wᵀ), and
u = (u_w, √(1 − u_alpha²), 0, …) with ‖u_w‖ = u_alpha = ‖Π_W u‖. Only G, u_w and the
vectors λ, c, ĉ enter the law of every trajectory.

Spec keys (JSON or TOML): ``activation, k, d, xi, W | gram, lam, c, c_hat, u_alpha, seed,
convention, teacher``, and the rank-r keys ``C, spectrum, C_hat``
(``dynamics.instances.lora_instance``; only the ``lora`` learner reads them, and they are kept in
the resolved spec).

A spec file may also carry a ``[run]`` table (key ``run``): the run options of ``loradyn run``
(learner, η, steps, batch, learner options such as ``mu``; ``sims.commands.run``).
:func:`read_spec_file` returns it apart; :func:`load_spec` drops it, so every command that
reads an instance accepts such a file.

``convention`` (default ``unit``, the model above) may name the paper's App. B simulation
convention instead: f(x) = (1/ξ) Σᵢ λᵢ σ(⟨vᵢ, x⟩) with the fixed row scale
vᵢ = s (wᵢ + ξcᵢu), s = k/(k + ξ²) (``appB``, as printed) or s = √(k/(k + ξ²)) (``appB-sqrt``,
the factor that keeps ‖vᵢ‖ ≈ 1 for c uniform on S^{k−1}); the student has the same form with
(ĉ, û). Rows are then not unit vectors, so the unit-row Hermite theory (h, Φ, Prop. 4's ODE)
does not apply: the loss is exact from the Gaussian pair kernel of rows of any norm
(``hermite.finetune.population``; Monte Carlo only for a piecewise σ other than relu/abs) and
only the ``finetune`` learner on the full engine runs it.

``teacher = "committee"`` makes the instance a generic committee-machine teacher instead of
a fine-tuned one, for the from-scratch learners (``scratch``, ``scratch-csq``): f*(x) =
Σᵢ λᵢ σ(⟨vᵢ, x⟩) with k = M rows vᵢ = the rows of W *as they are* (no perturbation, no
renormalisation: keys ``xi, c, c_hat, u_alpha, convention`` do not apply), λ = ``lam``
(default ``ones``: Saad & Solla's A = 1). ``W``: ``gaussian`` (rows i.i.d. N(0, I/d), so
T = VVᵀ is Wishart/d, sampled exactly), ``orthonormal`` (T = I), an explicit k×d array, or
``gram`` (any PSD T).
"""

from __future__ import annotations

import json
import math
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.linalg as sla

from dynamics.activations import Activation, get_activation

__all__ = [
    "Instance",
    "SpecError",
    "build_instance",
    "load_spec",
    "read_spec_file",
    "RUN_TABLE",
    "load_instance",
    "SPEC_KEYS",
    "W_GENERATORS",
    "LAM_GENERATORS",
    "C_GENERATORS",
    "CONVENTIONS",
    "TEACHERS",
    "distinct_instances",
]

SPEC_KEYS = ("activation", "k", "d", "xi", "W", "gram", "lam", "c", "c_hat", "u_alpha", "seed",
             "convention", "teacher", "C", "spectrum", "C_hat")
# rank-r teacher keys, read by dynamics.instances.lora_instance
RANK_KEYS = ("C", "spectrum", "C_hat")
CONVENTIONS = ("unit", "appB", "appB-sqrt")
TEACHERS = ("finetune", "committee")
W_GENERATORS = ("orthonormal", "separated", "claim2")
COMMITTEE_W_GENERATORS = ("gaussian", "orthonormal")
FINETUNE_ONLY_KEYS = ("xi", "c", "c_hat", "u_alpha", "convention", "C", "spectrum", "C_hat")
LAM_GENERATORS = ("ones", "uniform", "random_sign")
C_GENERATORS = ("quantized", "gaussian")
C_HAT_GENERATORS = C_GENERATORS + ("teacher",)
UNIT_NORM_TOL = 1e-8
RUN_TABLE = "run"  # a spec file's table of run options (module docstring)


class SpecError(ValueError):
    """A malformed instance specification; the message names the key and the problem."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"instance spec: key '{key}': {problem}")
        self.key = key


def _rng(seed: int, stream: str) -> np.random.Generator:
    """Independent, stable random stream per (seed, component name)."""
    return np.random.default_rng([int(seed), zlib.crc32(stream.encode())])


@dataclass(frozen=True)
class Instance:
    """One problem instance in its canonical frame (see module docstring).

    Fields: ``activation``; sizes ``k`` and ``d`` (``None`` when only h(m) is wanted);
    ``xi`` ≥ 0; ``gram`` G = WWᵀ (k×k); ``w_factor`` L with L Lᵀ = G (rows = wᵢ in an
    orthonormal basis of span W); ``u_w`` = Π_W u in that basis (‖u_w‖ = u_alpha);
    ``lam``, ``c``, ``c_hat`` (k-vectors); ``seed``; ``spec``, the resolved specification
    (JSON-serialisable), and ``diagnostics`` (e.g. max |⟨wᵢ,wⱼ⟩| against Assumption 5);
    ``teacher``: ``finetune`` (the model above) or ``committee`` (rows of W as given, ξ = 0).
    """

    activation: Activation
    k: int
    d: int | None
    xi: float
    gram: np.ndarray
    w_factor: np.ndarray
    u_w: np.ndarray
    lam: np.ndarray
    c: np.ndarray
    c_hat: np.ndarray
    seed: int
    spec: dict = field(default_factory=dict, compare=False)
    diagnostics: dict = field(default_factory=dict, compare=False)
    convention: str = "unit"
    teacher: str = "finetune"

    @property
    def committee(self) -> bool:
        """Whether the teacher is a generic committee machine (module docstring)."""
        return self.teacher == "committee"

    # ---- convention (module docstring)
    @property
    def unit_rows(self) -> bool:
        """Whether rows are renormalised to unit length (the theory's model)."""
        return self.convention == "unit"

    @property
    def row_scale(self) -> float:
        """The fixed row factor s of the App. B conventions (1 for ``unit``: unused there)."""
        if self.convention == "appB":
            return self.k / (self.k + self.xi**2)
        if self.convention == "appB-sqrt":
            return math.sqrt(self.k / (self.k + self.xi**2))
        return 1.0

    @property
    def output_scale(self) -> float:
        """Factor of the network output: 1/ξ in the App. B conventions, else 1."""
        return 1.0 if self.unit_rows else 1.0 / self.xi

    def _require_unit_rows(self, what: str) -> None:
        if not self.unit_rows:
            raise ValueError(f"{what} assumes unit rows; convention {self.convention!r} has "
                             "none (see hermite.finetune.population)")

    # ---- geometry of teacher and student neurons ---------------------------------
    @property
    def u_alpha(self) -> float:
        return float(np.linalg.norm(self.u_w))

    @property
    def u_perp(self) -> float:
        """‖Π_W^⊥ u‖ = √(1 − u_alpha²): the largest overlap a projected û can reach."""
        return math.sqrt(max(0.0, 1.0 - self.u_alpha**2))

    @property
    def w_dot_u(self) -> np.ndarray:
        """⟨wᵢ, u⟩ for each neuron."""
        return self.w_factor @ self.u_w

    def teacher_norms(self) -> np.ndarray:
        """Nᵢ = ‖wᵢ + ξ cᵢ u‖: the divisor of row i (1/s in the App. B conventions, 1 for a
        committee teacher: its rows are taken as they are)."""
        if self.committee:
            return np.ones(self.k)
        if not self.unit_rows:
            return np.full(self.k, 1.0 / self.row_scale)
        xi, c = self.xi, self.c
        return np.sqrt(1.0 + 2.0 * xi * c * self.w_dot_u + xi**2 * c**2)

    def student_norms(self, c_hat: np.ndarray | None = None) -> np.ndarray:
        """N̂ⱼ = ‖wⱼ + ξ ĉⱼ û‖ for û ⊥ span(W) (projected setting)."""
        ch = self.c_hat if c_hat is None else c_hat
        return np.sqrt(1.0 + self.xi**2 * ch**2)

    def correlation_affine(self, c_hat: np.ndarray | None = None):
        """(P, Q) with ρᵢⱼ(m) = ⟨vᵢ, v̂ⱼ⟩ = Pᵢⱼ + Qᵢⱼ m for û ⊥ span W, m = ⟨u, û⟩.

        Pᵢⱼ = (Gᵢⱼ + ξ cᵢ⟨wⱼ,u⟩)/(Nᵢ N̂ⱼ), Qᵢⱼ = ξ² cᵢ ĉⱼ/(Nᵢ N̂ⱼ).
        """
        self._require_unit_rows("the Hermite theory")
        ch = self.c_hat if c_hat is None else np.asarray(c_hat, dtype=float)
        n, nh = self.teacher_norms(), self.student_norms(ch)
        denom = np.outer(n, nh)
        p = (self.gram + self.xi * np.outer(self.c, self.w_dot_u)) / denom
        q = self.xi**2 * np.outer(self.c, ch) / denom
        return p, q

    def teacher_gram(self) -> np.ndarray:
        """⟨vᵢ, vⱼ⟩ of the teacher rows (unit rows; a committee teacher's T = VVᵀ)."""
        if self.committee:
            return np.array(self.gram)
        self._require_unit_rows("the teacher Gram matrix")
        xi, c, wu = self.xi, self.c, self.w_dot_u
        raw = self.gram + xi * (np.outer(wu, c) + np.outer(c, wu)) + xi**2 * np.outer(c, c)
        n = self.teacher_norms()
        return raw / np.outer(n, n)

    def student_gram(self, c_hat: np.ndarray | None = None) -> np.ndarray:
        """⟨v̂ᵢ, v̂ⱼ⟩ for û ⊥ span W (independent of û)."""
        self._require_unit_rows("the student Gram matrix")
        ch = self.c_hat if c_hat is None else c_hat
        nh = self.student_norms(ch)
        return (self.gram + self.xi**2 * np.outer(ch, ch)) / np.outer(nh, nh)

    def with_c_hat(self, c_hat) -> Instance:
        """The same instance with another student second-layer direction ĉ."""
        ch = np.asarray(c_hat, dtype=float)
        spec = dict(self.spec, c_hat=ch.tolist())
        return Instance(self.activation, self.k, self.d, self.xi, self.gram, self.w_factor,
                        self.u_w, self.lam, self.c, ch, self.seed, spec, self.diagnostics,
                        self.convention, self.teacher)


# ---------------------------------------------------------------- spec parsing
def load_spec(path) -> dict:
    """The instance keys of a spec file (:func:`read_spec_file` without its ``[run]`` table)."""
    return read_spec_file(path)[0]


def read_spec_file(path) -> tuple[dict, dict]:
    """Read a JSON or TOML instance spec (by extension; JSON is tried first otherwise) →
    (instance keys, its ``[run]`` table or {}). A path that cannot be read is a
    :class:`SpecError` (key ``file``) whose one line names it: ``instance spec nope.toml: no
    such file``; a ``run`` that is not a table is one line too."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            problem = "no such file"
        elif isinstance(exc, IsADirectoryError):
            problem = "is a directory, not a spec file"
        else:
            problem = f"cannot read it ({exc.strerror or type(exc).__name__})"
        err = SpecError("file", problem)
        err.args = (f"instance spec {path}: {problem}",)
        raise err from None
    try:
        if path.suffix.lower() == ".toml":
            spec = tomllib.loads(text)
        elif path.suffix.lower() == ".json":
            spec = json.loads(text)
        else:
            try:
                spec = json.loads(text)
            except json.JSONDecodeError:
                spec = tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecError("file", f"{path} is not valid JSON/TOML ({exc})") from None
    if not isinstance(spec, dict):
        raise SpecError("file", f"{path} must hold a table/object of keys")
    run = spec.pop(RUN_TABLE, {})
    if not isinstance(run, dict):
        raise SpecError(RUN_TABLE, f"{path}: must be a table of run options ([run])")
    return spec, run


def load_instance(path, **overrides) -> Instance:
    """Load and build an instance from a spec file; ``overrides`` replace spec keys."""
    spec = load_spec(path)
    spec.update({k: v for k, v in overrides.items() if v is not None})
    return build_instance(spec)


def _int_key(spec, key, minimum, required=True):
    if key not in spec or spec[key] is None:
        if required:
            raise SpecError(key, "is required")
        return None
    val = spec[key]
    if isinstance(val, bool) or not isinstance(val, (int, np.integer, float)) or val != int(val):
        raise SpecError(key, f"must be an integer, got {val!r}")
    if int(val) < minimum:
        raise SpecError(key, f"must be ≥ {minimum}, got {val}")
    return int(val)


def _float_key(spec, key, default, lo=None, hi=None, hi_open=False):
    val = spec.get(key, default)
    if isinstance(val, bool) or not isinstance(val, (int, float, np.floating, np.integer)):
        raise SpecError(key, f"must be a number, got {val!r}")
    val = float(val)
    if not math.isfinite(val):
        raise SpecError(key, f"must be finite, got {val}")
    if lo is not None and val < lo:
        raise SpecError(key, f"must be ≥ {lo}, got {val}")
    if hi is not None and (val >= hi if hi_open else val > hi):
        raise SpecError(key, f"must be {'<' if hi_open else '≤'} {hi}, got {val}")
    return val


def _vector(spec, key, k, default, generators, rng_seed) -> tuple[np.ndarray, object]:
    val = spec.get(key, default)
    rng = _rng(rng_seed, key)
    if isinstance(val, str):
        name = val.lower()
        if name not in generators:
            raise SpecError(key, f"unknown generator {val!r}; valid: {', '.join(generators)}")
        if name == "ones":
            return np.ones(k), name
        if name == "uniform":
            return np.full(k, 1.0 / k), name
        if name == "random_sign":
            return rng.choice([-1.0, 1.0], size=k), name
        if name == "quantized":
            return rng.choice([-1.0, 1.0], size=k) / math.sqrt(k), name
        if name == "gaussian":
            g = rng.standard_normal(k)
            return g / np.linalg.norm(g), name
        raise AssertionError(name)
    arr = _array(key, val)
    if arr.shape != (k,):
        raise SpecError(key, f"must have shape ({k},), got {arr.shape}")
    return arr, "explicit"


def _array(key, val) -> np.ndarray:
    try:
        arr = np.asarray(val, dtype=float)
    except (TypeError, ValueError):
        raise SpecError(key, f"must be a generator name or a numeric array, got {val!r}") from None
    if not np.all(np.isfinite(arr)):
        raise SpecError(key, "contains NaN or Inf")
    return arr


def _sample_separated_gram(k: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """Gram of k i.i.d. uniform unit vectors in R^d, sampled exactly in O(k²) (Bartlett)."""
    # Z Zᵀ ~ Wishart_k(d, I) for Z ∈ R^{k×d} Gaussian; Bartlett: A lower-triangular with
    # A_ii² ~ χ²_{d-i}, A_ij ~ N(0,1) below the diagonal, Z Zᵀ =_law A Aᵀ.
    a = np.tril(rng.standard_normal((k, k)), -1)
    a[np.diag_indices(k)] = np.sqrt(rng.chisquare(d - np.arange(k)))
    s = a @ a.T
    dinv = 1.0 / np.sqrt(np.diag(s))
    return s * np.outer(dinv, dinv)


def _factor(gram: np.ndarray) -> np.ndarray:
    """L with L Lᵀ = G (Cholesky, or a symmetric square root for singular PSD G)."""
    try:
        return np.linalg.cholesky(gram)
    except np.linalg.LinAlgError:
        vals, vecs = np.linalg.eigh(gram)
        return vecs * np.sqrt(np.clip(vals, 0.0, None))


def _check_gram(key, g, k):
    if g.shape != (k, k):
        raise SpecError(key, f"must have shape ({k}, {k}), got {g.shape}")
    if not np.allclose(g, g.T, atol=1e-10):
        raise SpecError(key, "must be symmetric")
    if np.max(np.abs(np.diag(g) - 1.0)) > UNIT_NORM_TOL:
        raise SpecError(key, "rows of W must have unit norm (diagonal of the Gram matrix ≠ 1)")
    if np.linalg.eigvalsh(g)[0] < -1e-10:
        raise SpecError(key, "is not positive semi-definite")


def build_instance(spec: dict) -> Instance:
    """Validate a spec dict and build the :class:`Instance` (explicit arrays win)."""
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(unknown[0], f"unknown key; valid keys: {', '.join(SPEC_KEYS)}")
    if "activation" not in spec:
        raise SpecError("activation", "is required")
    try:
        act = get_activation(spec["activation"])
    except ValueError as exc:
        raise SpecError("activation", str(exc)) from None
    k = _int_key(spec, "k", 1)
    d = _int_key(spec, "d", 1, required=False)
    teacher = str(spec.get("teacher", "finetune"))
    if teacher not in TEACHERS:
        raise SpecError("teacher", f"unknown teacher {teacher!r}; valid: {', '.join(TEACHERS)}")
    if teacher == "committee":
        return _committee_instance(spec, act, k, d)
    xi = _float_key(spec, "xi", 1.0, lo=0.0)
    u_alpha = _float_key(spec, "u_alpha", 0.0, lo=0.0, hi=1.0, hi_open=True)
    seed = _int_key(spec, "seed", 0, required=False) or 0
    if d is not None and d < k + 2:
        raise SpecError("d", f"must be ≥ k + 2 = {k + 2} (span W, u and one free direction)")
    convention = str(spec.get("convention", "unit"))
    if convention not in CONVENTIONS:
        raise SpecError("convention", f"unknown convention {convention!r}; valid: "
                                      f"{', '.join(CONVENTIONS)}")
    if convention != "unit" and xi <= 0:
        raise SpecError("convention", f"{convention!r} scales the output by 1/ξ: needs ξ > 0")

    c, c_name = _vector(spec, "c", k, "quantized", C_GENERATORS, seed)
    lam, lam_name = _vector(spec, "lam", k, "ones", LAM_GENERATORS, seed)
    ch_val = spec.get("c_hat", "quantized")
    if isinstance(ch_val, str) and ch_val.lower() == "teacher":
        c_hat, ch_name = c.copy(), "teacher"
    else:
        c_hat, ch_name = _vector(spec, "c_hat", k, "quantized", C_GENERATORS, seed)

    diagnostics: dict = {}
    gram, w_name, basis_factor = _resolve_w(spec, k, d, xi, c, seed, diagnostics)
    if basis_factor is None:
        basis_factor = _factor(gram)
    rng_u = _rng(seed, "u_alpha")
    direction = rng_u.standard_normal(k)
    u_w = u_alpha * direction / np.linalg.norm(direction)

    resolved = {
        "activation": act.name, "k": k, "d": d, "xi": xi, "u_alpha": u_alpha, "seed": seed,
        "W": w_name, "lam": lam_name, "c": c_name, "c_hat": ch_name, "convention": convention,
        "values": {"gram": gram.tolist(), "lam": lam.tolist(), "c": c.tolist(),
                   "c_hat": c_hat.tolist(), "u_w": u_w.tolist()},
    } | {key: spec[key] for key in RANK_KEYS if key in spec}
    return Instance(act, k, d, xi, gram, basis_factor, u_w, lam, c, c_hat, seed,
                    resolved, diagnostics, convention)


def _resolve_w(spec, k, d, xi, c, seed, diagnostics):
    """Return (G, name, factor-or-None) from W / gram keys; explicit arrays win."""
    if "W" in spec and not isinstance(spec["W"], str):
        w = _array("W", spec["W"])
        if w.ndim != 2 or w.shape[0] != k:
            raise SpecError("W", f"must be a k×d array with k = {k}, got shape {w.shape}")
        if d is not None and w.shape[1] != d:
            raise SpecError("W", f"has {w.shape[1]} columns but d = {d}")
        norms = np.linalg.norm(w, axis=1)
        if np.max(np.abs(norms - 1.0)) > UNIT_NORM_TOL:
            raise SpecError("W", f"rows must have unit norm, got norms in "
                                 f"[{norms.min():.6g}, {norms.max():.6g}]")
        if w.shape[1] < k:
            raise SpecError("W", "needs at least k columns")
        # canonical frame: W = R Qᵀ with Q orthonormal (d×k) ⇒ rows of R are the wᵢ
        _, r = sla.qr(w.T, mode="economic")
        factor = r.T
        return w @ w.T, "explicit", factor
    if "gram" in spec and spec["gram"] is not None:
        g = _array("gram", spec["gram"])
        _check_gram("gram", g, k)
        return 0.5 * (g + g.T), "gram", None
    name = str(spec.get("W", "orthonormal")).lower()
    if name not in W_GENERATORS:
        raise SpecError("W", f"unknown generator {spec['W']!r}; valid: {', '.join(W_GENERATORS)}"
                             " or an explicit k×d array")
    if name == "orthonormal":
        if d is not None and k > d:
            raise SpecError("W", f"orthonormal rows need k ≤ d, got k = {k} > d = {d}")
        return np.eye(k), name, np.eye(k)
    if name == "separated":
        if d is None:
            raise SpecError("d", "is required for W = 'separated' (rows uniform on S^{d-1})")
        g = _sample_separated_gram(k, d, _rng(seed, "W"))
        off = np.abs(g - np.eye(k)).max() if k > 1 else 0.0
        bound = 1.0 - math.log(k) / math.sqrt(k) if k > 1 else 1.0
        diagnostics.update(max_abs_w_overlap=float(off), assumption5_bound=bound,
                           assumption5_holds=bool(off <= bound))
        return g, name, None
    # claim2 (App. C.3): ⟨wᵢ, wⱼ⟩ = −ξ² cᵢ cⱼ (i ≠ j), so the teacher rows are orthonormal
    if d is not None and d <= 1 + k * (k + 1) // 2:
        raise SpecError("d", f"Claim 2 needs d > 1 + k(k+1)/2 = {1 + k * (k + 1) // 2}, got {d}")
    g = -(xi**2) * np.outer(c, c)
    np.fill_diagonal(g, 1.0)
    if np.linalg.eigvalsh(g)[0] < -1e-12:
        raise SpecError("W", f"claim2 Gram 1 − ξ²cᵢcⱼ is not PSD for xi = {xi} (needs ξ²‖c‖² ≲ 1)")
    return g, name, None


def _committee_instance(spec: dict, act: Activation, k: int, d: int | None) -> Instance:
    """A committee-machine teacher (module docstring): T from ``W`` / ``gram``, λ = ``lam``."""
    for key in FINETUNE_ONLY_KEYS:
        if key in spec:
            raise SpecError(key, "does not apply to a committee teacher (teacher = "
                                 "'committee' has no perturbation ξ c uᵀ)")
    seed = _int_key(spec, "seed", 0, required=False) or 0
    if d is None:
        raise SpecError("d", "is required for a committee teacher")
    if d < k + 2:
        raise SpecError("d", f"must be ≥ k + 2 = {k + 2}")
    lam, lam_name = _vector(spec, "lam", k, "ones", LAM_GENERATORS, seed)
    factor = None
    if "W" in spec and not isinstance(spec["W"], str):
        w = _array("W", spec["W"])
        if w.ndim != 2 or w.shape != (k, d):
            raise SpecError("W", f"must be a k×d = {k}×{d} array, got shape {w.shape}")
        _, r = sla.qr(w.T, mode="economic")
        factor, gram, w_name = r.T, w @ w.T, "explicit"
    elif "gram" in spec and spec["gram"] is not None:
        gram = _array("gram", spec["gram"])
        if gram.shape != (k, k) or not np.allclose(gram, gram.T, atol=1e-10):
            raise SpecError("gram", f"must be a symmetric ({k}, {k}) matrix")
        if np.linalg.eigvalsh(gram)[0] < -1e-10:
            raise SpecError("gram", "is not positive semi-definite")
        gram, w_name = 0.5 * (gram + gram.T), "gram"
    else:
        w_name = str(spec.get("W", "gaussian")).lower()
        if w_name not in COMMITTEE_W_GENERATORS:
            raise SpecError("W", f"unknown generator {spec['W']!r} for a committee teacher; "
                                 f"valid: {', '.join(COMMITTEE_W_GENERATORS)} or an explicit "
                                 "k×d array")
        if w_name == "orthonormal":
            gram = np.eye(k)
        else:  # rows i.i.d. N(0, I/d): VVᵀ = A Aᵀ/d with Bartlett's A (exact in O(k²))
            a = np.tril(_rng(seed, "W").standard_normal((k, k)), -1)
            a[np.diag_indices(k)] = np.sqrt(_rng(seed, "W-chi2").chisquare(d - np.arange(k)))
            factor = a / math.sqrt(d)
            gram = factor @ factor.T
    if factor is None:
        factor = _factor(gram)
    zeros = np.zeros(k)
    resolved = {"activation": act.name, "k": k, "d": d, "seed": seed, "teacher": "committee",
                "W": w_name, "lam": lam_name,
                "values": {"gram": gram.tolist(), "lam": lam.tolist()}}
    return Instance(act, k, d, 0.0, gram, factor, zeros, lam, zeros, zeros.copy(), seed,
                    resolved, {}, "unit", "committee")


def distinct_instances(instances) -> tuple[list[Instance], np.ndarray]:
    """The distinct instances of a per-run list (by identity, in first-seen order) and each
    run's index into them (R,) int64: what a trajectory file stores once per instance."""
    seen: dict[int, int] = {}
    order, index = [], []
    for inst in instances:
        if id(inst) not in seen:
            seen[id(inst)] = len(order)
            order.append(inst)
        index.append(seen[id(inst)])
    return order, np.asarray(index, dtype=np.int64)
