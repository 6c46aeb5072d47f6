"""The scaling law L(N, D) = E + A / N^alpha + B / D^beta, fitted to the losses of proxy runs.

This is the Chinchilla form (Hoffmann et al. 2022, approach 3): E is the loss no model reaches,
the two power laws what a finite model (N parameters) and a finite run (D tokens) add to it.
It is fitted as they did, minimising the Huber loss (delta 1e-3) of the residuals in log space,
but solved without a general optimiser: for fixed exponents the law is linear in (E, A, B),
so a grid over (alpha, beta) is searched and at each point (E, A, B) is the exact non-negative
least-squares solution (three unknowns: the best of the subsets of free coefficients whose
unconstrained solution is non-negative). The grid is then refined around its best point, and
the Huber loss is met by re-weighting (iteratively re-weighted least squares on the relative
residuals, which equal the log residuals to first order). Everything is deterministic, needs
only numpy, and a coefficient can never go negative (a law whose loss grows with size or data).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshtron.errors import MeshtronError

HUBER_DELTA = 1e-3
"""Hoffmann et al.'s delta: residuals in log-loss beyond it count linearly (robust to an
outlying point: a proxy whose last evaluation was unlucky)."""
EXPONENTS = (0.02, 2.0)
"""The range searched for alpha and beta (published fits: 0.07-0.7)."""
GRID = 41
REFINEMENTS = 3
REWEIGHTS = 4
SUBSETS = [s for r in (1, 2, 3) for s in itertools.combinations(range(3), r)]


@dataclass(frozen=True)
class ScalingLaw:
    """Predicted loss of a model of ``n`` parameters trained on ``d`` tokens."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def as_dict(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "alpha": self.alpha, "B": self.B, "beta": self.beta}


CHINCHILLA = ScalingLaw(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)
"""Hoffmann et al.'s published fit (MassiveText, their tokenizer): for planning at a scale no
proxy reaches, ``--law chinchilla``. N counts all parameters there."""


@dataclass(frozen=True)
class Point:
    """One observed loss: a model of ``n`` (law) parameters after ``d`` tokens."""

    n: float
    d: float
    loss: float
    run: str = ""
    """Which proxy run it came from (the hold-out check leaves out whole runs)."""


@dataclass(frozen=True)
class Fit:
    law: ScalingLaw
    residuals: tuple[float, ...]
    """log(predicted) - log(observed) per point, in the order given."""
    holdout: dict[str, float] = field(default_factory=dict)
    """Per proxy run: the relative error predicting its last point from a fit to the other
    runs (an honest measure of extrapolation to an unseen size); empty with under 3 runs."""
    warnings: tuple[str, ...] = ()

    @property
    def rms(self) -> float:
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals))

    @property
    def max_abs(self) -> float:
        return max(abs(r) for r in self.residuals)

    def summary(self) -> dict:
        return {"law": self.law.as_dict(), "points": len(self.residuals),
                "rms_log_residual": self.rms, "max_abs_log_residual": self.max_abs,
                "holdout_relative_error": self.holdout, "warnings": list(self.warnings)}


def _nnls_batch(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted non-negative least squares of ``y ~ x @ c`` for a batch of design matrices
    ``x`` (G, n, 3): the coefficients (G, 3) and the weighted squared error (G,). Exact for
    three unknowns: every optimum is the unconstrained solution on its own support."""
    sw = np.sqrt(w)
    xw, yw = x * sw[None, :, None], (y * sw)[None, :]
    best_err = np.full(x.shape[0], np.inf)
    best = np.zeros((x.shape[0], 3))
    for subset in SUBSETS:
        cols = list(subset)
        a = xw[:, :, cols]
        gram = np.einsum("gni,gnj->gij", a, a) + 1e-12 * np.eye(len(cols))[None]
        rhs = np.einsum("gni,gn->gi", a, yw)
        coef = np.linalg.solve(gram, rhs[..., None])[..., 0]
        err = ((np.einsum("gni,gi->gn", a, coef) - yw) ** 2).sum(axis=1)
        ok = (coef >= 0).all(axis=1) & (err < best_err)
        full = np.zeros((x.shape[0], 3))
        full[:, cols] = coef
        best[ok], best_err[ok] = full[ok], err[ok]
    return best, best_err


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


class _Problem:
    """The points, scaled so that the reference model and run are 1 (well-conditioned)."""

    def __init__(self, points: Sequence[Point]):
        self.n = np.array([p.n for p in points], dtype=float)
        self.d = np.array([p.d for p in points], dtype=float)
        self.y = np.array([p.loss for p in points], dtype=float)
        self.n0 = float(np.exp(np.log(self.n).mean()))
        self.d0 = float(np.exp(np.log(self.d).mean()))
        self.ln, self.ld = np.log(self.n / self.n0), np.log(self.d / self.d0)

    def solve(self, alphas: np.ndarray, betas: np.ndarray, w: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For every (alpha, beta) pair: the scaled (E, a, b) and the Huber loss."""
        x = np.stack([np.ones((len(alphas), len(self.y))),
                      np.exp(-alphas[:, None] * self.ln[None]),
                      np.exp(-betas[:, None] * self.ld[None])], axis=2)
        coef, _ = _nnls_batch(x, self.y, w / self.y ** 2)
        predicted = np.maximum(np.einsum("gni,gi->gn", x, coef), 1e-12)
        loss = _huber(np.log(predicted) - np.log(self.y)[None], HUBER_DELTA).sum(axis=1)
        return alphas, betas, coef, loss

    def law(self, alpha: float, beta: float, coef: np.ndarray) -> ScalingLaw:
        e, a, b = (float(v) for v in coef)
        return ScalingLaw(E=e, A=a * self.n0 ** alpha, alpha=alpha, B=b * self.d0 ** beta,
                          beta=beta)


def _grid_search(problem: _Problem, w: np.ndarray) -> tuple[float, float, np.ndarray]:
    """The best (alpha, beta) on a grid, refined around its best point."""
    lo, hi = EXPONENTS
    axis = np.linspace(lo, hi, GRID)
    a_axis, b_axis = axis, axis
    for _ in range(REFINEMENTS + 1):
        aa, bb = np.meshgrid(a_axis, b_axis, indexing="ij")
        alphas, betas, coef, loss = problem.solve(aa.ravel(), bb.ravel(), w)
        i = int(np.argmin(loss))
        alpha, beta, best = float(alphas[i]), float(betas[i]), coef[i]
        step_a = (a_axis[1] - a_axis[0]) if len(a_axis) > 1 else 0.0
        step_b = (b_axis[1] - b_axis[0]) if len(b_axis) > 1 else 0.0
        a_axis = np.linspace(max(lo, alpha - step_a), min(hi, alpha + step_a), 21)
        b_axis = np.linspace(max(lo, beta - step_b), min(hi, beta + step_b), 21)
    return alpha, beta, best


def fit_law(points: Sequence[Point], *, holdout: bool = True) -> Fit:
    """Fit the law to ``points``; needs at least five points, two model sizes and two token
    counts. ``holdout`` adds the leave-one-run-out check."""
    check_points(points)
    problem = _Problem(points)
    w = np.ones(len(points))
    for _ in range(REWEIGHTS):
        alpha, beta, coef = _grid_search(problem, w)
        law = problem.law(alpha, beta, coef)
        r = np.array([math.log(law.loss(p.n, p.d) / p.loss) for p in points])
        # Huber's weights: 1 inside delta, delta / |r| beyond (floored: a perfect point
        # must not take all the weight)
        w = np.minimum(1.0, HUBER_DELTA / np.maximum(np.abs(r), 1e-12))
    residuals = tuple(math.log(law.loss(p.n, p.d) / p.loss) for p in points)
    return Fit(law, residuals, holdout_errors(points) if holdout else {}, _warnings(law))


def _warnings(law: ScalingLaw) -> tuple[str, ...]:
    said = []
    if law.A == 0:
        said.append("the fit found no effect of model size (A = 0): the proxies' sizes may be "
                    "too close together or their runs too short; the smallest shapes win")
    if law.B == 0:
        said.append("the fit found no effect of training tokens (B = 0): the proxies may have "
                    "stopped improving (over-fitting a small corpus?); the largest shapes win")
    lo, hi = EXPONENTS
    for name, value in (("alpha", law.alpha), ("beta", law.beta)):
        if value <= lo + 1e-9 or value >= hi - 1e-9:
            said.append(f"{name} = {value:.3g} sits at the edge of the searched range "
                        f"[{lo}, {hi}]: the data do not pin it down")
    return tuple(said)


def check_points(points: Sequence[Point]) -> None:
    if len(points) < 5:
        raise MeshtronError(f"a scaling-law fit needs at least 5 losses (5 unknowns), got "
                            f"{len(points)}")
    if len({p.n for p in points}) < 2:
        raise MeshtronError("a scaling-law fit needs losses of at least 2 model sizes "
                            "(only one proxy shape finished)")
    if len({p.d for p in points}) < 2:
        raise MeshtronError("a scaling-law fit needs losses at at least 2 token counts")
    bad = [p for p in points if not (p.loss > 0 and math.isfinite(p.loss) and p.n > 0
                                     and p.d > 0)]
    if bad:
        raise MeshtronError(f"a loss of {bad[0].loss} (run {bad[0].run or '?'}) cannot be fitted: "
                            "losses, sizes and token counts must be positive and finite")


def holdout_errors(points: Sequence[Point]) -> dict[str, float]:
    """For each run: fit the others, predict the run's last (largest-D) point."""
    runs = sorted({p.run for p in points})
    errors: dict[str, float] = {}
    if len(runs) < 3:
        return errors
    for run in runs:
        rest = [p for p in points if p.run != run]
        try:
            check_points(rest)
        except MeshtronError:
            continue
        law = fit_law(rest, holdout=False).law
        last = max((p for p in points if p.run == run), key=lambda p: p.d)
        errors[run] = law.loss(last.n, last.d) / last.loss - 1.0
    return errors


def parse_law(text: str) -> ScalingLaw:
    """``--law``: ``chinchilla``, ``E,A,alpha,B,beta``, or a JSON file holding ``law`` (as
    ``meshtron archsearch --json`` writes it under ``fit``)."""
    import json
    from pathlib import Path

    if text == "chinchilla":
        return CHINCHILLA
    parts = text.split(",")
    if len(parts) == 5:
        try:
            e, a, alpha, b, beta = (float(v) for v in parts)
        except ValueError:
            raise MeshtronError(f"--law {text}: expected five numbers E,A,alpha,B,beta") \
                from None
        values = {"E": e, "A": a, "alpha": alpha, "B": b, "beta": beta}
    else:
        path = Path(text)
        if not path.is_file():
            raise MeshtronError(f"--law {text}: not 'chinchilla', five numbers E,A,alpha,B,beta"
                                " or a JSON file")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise MeshtronError(f"--law {text}: cannot read it as JSON ({err})") from None
        values = raw.get("fit", raw).get("law", raw) if isinstance(raw, dict) else None
        if not isinstance(values, dict):
            raise MeshtronError(f"--law {text}: no 'law' object in the file")
    try:
        law = ScalingLaw(**{k: float(values[k]) for k in ("E", "A", "alpha", "B", "beta")})
    except (KeyError, TypeError, ValueError):
        raise MeshtronError(f"--law {text}: needs numbers E, A, alpha, B and beta") from None
    if not all(math.isfinite(v) and v >= 0 for v in law.as_dict().values()):
        raise MeshtronError(f"--law {text}: the coefficients must be finite and non-negative")
    return law
