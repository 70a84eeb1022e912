"""The learning-rate schedules (train.lr_schedule), each a linear warmup from 0 to train.lr and then:

    cosine    cosine decay to lr * min_lr_ratio at the schedule's end
    linear    linear decay to lr * min_lr_ratio at the schedule's end
    constant  lr to the end
    wsd       warmup-stable-decay: lr until the last train.decay_fraction of the schedule, then a linear
              decay to lr * min_lr_ratio at its end (a run can branch off the stable phase and decay alone)

The schedule's length is `train.schedule_steps` (default `train.steps`), so a run stopped early and
resumed with a larger `train.steps` keeps the learning rate it would have had; past the end the rate
stays at its final value.
"""
from __future__ import annotations

import optax

from meshtrain.config import TrainConfig


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """The rate of optimizer step i (0-based) is `lr_schedule(t)(i)`."""
    total = t.total_schedule_steps
    # A warmup longer than the whole schedule is cut to it (a short trial run of a long config).
    warmup = min(t.warmup_steps, total)
    peak, end = t.lr, t.lr * t.min_lr_ratio
    if t.lr_schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=max(total, warmup + 1), end_value=end)
    elif t.lr_schedule == "linear":
        base = _after_warmup(peak, warmup, [optax.linear_schedule(peak, end, max(total - warmup, 1))], [])
    elif t.lr_schedule == "constant":
        base = _after_warmup(peak, warmup, [optax.constant_schedule(peak)], [])
    else:  # wsd
        decay_start = max(total - wsd_decay_steps(t), warmup)
        base = _after_warmup(peak, warmup, [optax.constant_schedule(peak),
                                            optax.linear_schedule(peak, end, max(total - decay_start, 1))],
                             [decay_start])
    # Step i trains with the rate at i + 1: the first step already moves (lr/warmup), the last warmup
    # step reaches the peak, the last step of the schedule trains at its end value.
    return lambda count: base(count + 1)


def wsd_decay_steps(t: TrainConfig) -> int:
    """The steps of wsd's final decay: train.decay_fraction of the schedule, at least one."""
    return max(round(t.decay_fraction * t.total_schedule_steps), 1)


def _after_warmup(peak: float, warmup: int, phases: list[optax.Schedule], starts: list[int]) -> optax.Schedule:
    """A linear warmup from 0 to `peak` over `warmup` steps, then `phases` starting at `warmup` and at the
    later absolute `starts`; each phase counts its steps from its own start."""
    # The warmup phase is never reached when warmup is 0; its length stays 1 so that optax does not warn.
    ramp = optax.linear_schedule(0.0, peak, max(warmup, 1))
    return optax.join_schedules([ramp, *phases], [warmup, *starts])
