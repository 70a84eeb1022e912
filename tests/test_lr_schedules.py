"""train.lr_schedule: the rate of every step against the schedule's formula.

Step i (0-based) trains at the formula's value at t = i + 1, so that the first step already moves and the
last step of the schedule trains at its end value. fp32 arithmetic in optax: rtol 1e-6.
"""
import math

import numpy as np
import pytest

from meshtrain.config import build_config
from meshtrain.step.lr_schedules import lr_schedule

LR, END_RATIO, WARMUP, TOTAL = 2e-3, 0.1, 10, 100


def train(*overrides: str):
    return build_config({}, [f"train.lr={LR}", f"train.min_lr_ratio={END_RATIO}", f"train.warmup_steps={WARMUP}",
                             f"train.steps={TOTAL}", *overrides]).train


def formula(kind: str, t: int, *, warmup: int = WARMUP, total: int = TOTAL, decay_fraction: float = 0.2) -> float:
    """The rate at t (1 .. total, and on past it) written out from the schedule's definition."""
    peak, end = LR, LR * END_RATIO
    if t < warmup:
        return peak * t / warmup
    done = min((t - warmup) / (total - warmup), 1.0)  # the share of the post-warmup phase behind
    if kind == "cosine":
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * done))
    if kind == "linear":
        return peak + (end - peak) * done
    if kind == "constant":
        return peak
    decay_start = total - round(decay_fraction * total)  # wsd
    return peak if t < decay_start else peak + (end - peak) * min((t - decay_start) / (total - decay_start), 1.0)


def rates(t) -> np.ndarray:
    return np.asarray(lr_schedule(t)(np.arange(TOTAL + 20)))  # 20 steps past the end: a resumed, longer run


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_every_step_follows_the_formula(kind):
    want = [formula(kind, i + 1) for i in range(TOTAL + 20)]
    np.testing.assert_allclose(rates(train(f"train.lr_schedule={kind}")), want, rtol=1e-6)


def test_landmarks():
    """The points a user reads off a plot: the warmup's first step and peak, wsd's plateau and decay start,
    every decaying schedule's end value on the last step."""
    cosine, wsd = rates(train()), rates(train("train.lr_schedule=wsd", "train.decay_fraction=0.3"))
    assert cosine[0] == pytest.approx(LR / WARMUP) and cosine[WARMUP - 1] == pytest.approx(LR)
    # wsd: the rate holds at lr up to step 70 (t = 70 = 100 - 30), then falls linearly to the end value.
    np.testing.assert_allclose(wsd[WARMUP - 1:70], LR, rtol=1e-6)
    assert wsd[70] < LR and wsd[84] == pytest.approx(LR - (LR - LR * END_RATIO) * 15 / 30)
    for r in (cosine, wsd, rates(train("train.lr_schedule=linear"))):
        assert r[TOTAL - 1] == pytest.approx(LR * END_RATIO) and r[-1] == pytest.approx(LR * END_RATIO)


def test_wsd_decay_fraction_and_short_runs():
    # All decay: wsd is the linear schedule.
    np.testing.assert_allclose(rates(train("train.lr_schedule=wsd", "train.decay_fraction=1")),
                               rates(train("train.lr_schedule=linear")), rtol=1e-6)
    # A decay longer than what the warmup leaves starts right after the warmup.
    np.testing.assert_allclose(rates(train("train.lr_schedule=wsd", "train.decay_fraction=0.95")),
                               [formula("linear", i + 1) for i in range(TOTAL + 20)], rtol=1e-6)
    # No warmup: the first step trains at the peak.
    for kind in ("cosine", "linear", "constant", "wsd"):
        first = rates(train(f"train.lr_schedule={kind}", "train.warmup_steps=0"))[0]
        assert first == pytest.approx(formula(kind, 1, warmup=0)), kind


def test_schedule_steps_sets_the_length():
    """train.schedule_steps, not train.steps, is the schedule's length (a run stopped early keeps its rate)."""
    short = lr_schedule(train("train.lr_schedule=wsd", "train.steps=40", f"train.schedule_steps={TOTAL}"))
    np.testing.assert_allclose(np.asarray(short(np.arange(TOTAL))), rates(train("train.lr_schedule=wsd"))[:TOTAL],
                               rtol=1e-6)
