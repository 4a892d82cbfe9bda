"""Load predictors: each takes one observation per planner interval (request rate, mean ISL or mean OSL) and
predicts the value `steps` intervals ahead (the planner's horizon over its interval). Pure and deterministic:
the same observations give the same prediction.

- `constant`: the last observation (what the planner would see if the load held still);
- `ewma`: an exponentially weighted moving average (`alpha` weights the newest observation): smooths noise,
  lags a trend;
- `holt`: Holt's linear trend method (double exponential smoothing: a level and a slope, each smoothed), so
  a rising or falling load is extrapolated one interval ahead instead of lagging behind it; the prediction
  is never negative.

A non-finite observation (NaN: no requests in the window, so no mean ISL) is skipped: the prediction stays
what it was. Before any observation every predictor predicts `None`.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

__all__ = ["PREDICTORS", "ConstantPredictor", "EwmaPredictor", "HoltPredictor", "Predictor", "PredictorName",
           "make_predictor"]

PredictorName = Literal["constant", "ewma", "holt"]


class Predictor(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self, steps: float = 1.0) -> float | None:
        """The value `steps` intervals after the last observation (a level without a trend: the same for any)."""
        ...


class ConstantPredictor:
    def __init__(self) -> None:
        self._last: float | None = None

    def observe(self, value: float) -> None:
        if math.isfinite(value):
            self._last = value

    def predict(self, steps: float = 1.0) -> float | None:
        return self._last


class EwmaPredictor:
    def __init__(self, alpha: float = 0.5) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._level: float | None = None

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self._level = value if self._level is None else self.alpha * value + (1 - self.alpha) * self._level

    def predict(self, steps: float = 1.0) -> float | None:
        return self._level


class HoltPredictor:
    """Level and trend, smoothed by `alpha` and `beta`; predicts `level + steps * trend`."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 < beta <= 1):
            raise ValueError(f"alpha and beta must be in (0, 1], got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        if self._level is None:
            self._level = value
            return
        previous = self._level
        self._level = self.alpha * value + (1 - self.alpha) * (previous + self._trend)
        self._trend = self.beta * (self._level - previous) + (1 - self.beta) * self._trend

    def predict(self, steps: float = 1.0) -> float | None:
        if self._level is None:
            return None
        return max(0.0, self._level + steps * self._trend)


PREDICTORS: dict[str, type[ConstantPredictor] | type[EwmaPredictor] | type[HoltPredictor]] = {
    "constant": ConstantPredictor, "ewma": EwmaPredictor, "holt": HoltPredictor}


def make_predictor(name: str) -> Predictor:
    """A fresh predictor of kind `name` (constant, ewma, holt) with its default smoothing."""
    try:
        return PREDICTORS[name]()
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; choose one of {', '.join(PREDICTORS)}") from None
