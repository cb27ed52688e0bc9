"""Statistics of benchmark figures: percentiles, summaries, ratios, and their printing."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std, min, max and the given percentiles (NaN when empty)."""
    out: dict[str, float] = {}
    n = len(values)
    out["mean"] = sum(values) / n if n else math.nan
    out["median"] = percentile(values, 50)
    out["std"] = math.sqrt(sum((v - out["mean"]) ** 2 for v in values) / n) if n else math.nan
    out["min"] = min(values) if n else math.nan
    out["max"] = max(values) if n else math.nan
    for p in percentiles:
        out[f"p{p:g}"] = percentile(values, p)
    return out


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# Student's t, two-sided 95%, by degrees of freedom (1..30; the normal's 1.96 beyond).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """The mean of ``values`` and its two-sided 95% confidence interval (Student's t, the
    values taken as independent draws): (mean, low, high); NaN bounds under two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing, NaN or b is 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def fmt(value: float | None, digits: int = 2) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def nan_to_none(obj):
    """``obj`` with every NaN/inf float replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_none(v) for v in obj]
    return obj
