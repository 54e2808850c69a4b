"""The Scylla scaling study's model (eval/scylla_scaling.py runs the study, eval/scylla_report.py writes it up):
the log-linear fit of per-token acceptance against draft size and training tokens, and the speedup a chain of
k drafted tokens gives at a per-token acceptance alpha and a draft step's cost. Pure functions."""
from __future__ import annotations

import numpy as np

SHIPPED = "h384_l2"  # the shape of assets/text_drafters/smollm2/fastdraft_scratch (FastDraft from noise)


def fit_loglinear(params, tokens, alpha) -> dict:
    """Least squares alpha = a + b*ln(params) + c*ln(tokens); coefficients, R^2, residuals, predictions."""
    params, tokens, alpha = (np.asarray(x, dtype=np.float64) for x in (params, tokens, alpha))
    if len(alpha) < 3:
        raise ValueError(f"a fit of 3 coefficients needs >= 3 runs, got {len(alpha)}")
    design = np.stack([np.ones_like(alpha), np.log(params), np.log(tokens)], 1)  # [R, 3]
    coef, *_ = np.linalg.lstsq(design, alpha, rcond=None)
    predicted = design @ coef
    residuals = alpha - predicted
    total = float(((alpha - alpha.mean()) ** 2).sum())
    r2 = 1.0 - float((residuals ** 2).sum()) / total if total > 0 else 1.0
    return dict(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), r2=r2,
                rmse=float(np.sqrt((residuals ** 2).mean())), residuals=residuals.tolist(),
                predicted=predicted.tolist())


def predict_alpha(fit: dict, params, tokens):
    """The fit's alpha at (params, tokens): unclipped (a log-linear law leaves [0, 1] when extrapolated)."""
    return fit["a"] + fit["b"] * np.log(params) + fit["c"] * np.log(tokens)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verification step of a k-token chain with iid per-token acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, cost: float) -> float:
    """Modelled speedup over plain decoding: tokens per step / (1 + k * draft step cost in target steps)."""
    return expected_tokens(alpha, k) / (1.0 + k * cost)


def best_chain(alpha: float, cost: float, max_k: int = 16) -> tuple[int, float]:
    """(k, speedup) maximising the modelled speedup over k = 0..max_k (k = 0: no drafting, 1.0)."""
    alpha = min(max(float(alpha), 0.0), 1.0)
    return max(((k, speedup(alpha, k, cost)) for k in range(max_k + 1)), key=lambda x: (x[1], -x[0]))


def break_even_alpha(target: float, cost: float, max_k: int = 16) -> float:
    """The smallest alpha whose best chain at ``cost`` reaches modelled speedup ``target`` (bisection;
    the best speedup grows monotonically with alpha). 1.0 when even alpha = 1 falls short."""
    if best_chain(1.0, cost, max_k)[1] < target:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best_chain(mid, cost, max_k)[1] >= target else (mid, hi)
    return hi
