"""`max_minutes` (ours): a run's step count fitted to a time budget on the machine it runs on.

The same recipe takes 1.7 s a step on one 2-core CPU and 1.1 s on another (bf16 units), so a
fixed `trainer.max_steps` is an hour on one and half an hour on the other. With `max_minutes`
set, the run times its own optimizer steps from step `start` to step `at`, then fixes its step
count to what the budget buys at that pace, `trainer.max_steps` being the cap. The cosine
schedule decays to that count, so the LR reaches its floor when the time is up.

`at` comes before the end of the warmup wherever the warmup allows it (`fix_step`): the warmup's
LR does not depend on the count, so every LR of the run is the one a run of `trainer.max_steps=
<count>` would take. The count is fixed once: a checkpoint saves it and a resumed run keeps it
(never more than the cap it resumes with). Until it is fixed, a checkpoint saves the seconds
trained so far, so that time spent before a kill counts against the budget.

The budget buys optimizer steps: validation (with val/tau) is timed and left out of both the
pace and the time spent, and comes on top.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import lightning.pytorch as pl

log = logging.getLogger(__name__)

START = 5  # the first steps, slower while caches and allocators warm up, are not timed
AT = 30  # the step that fixes the count, at most
MIN_TIMED = 5  # fewer timed steps than this are too few to go by


def _now() -> float:
    return time.perf_counter()


def fix_step(warmup_steps: int) -> int:
    """The step that fixes the count: the last one of the warmup, up to step 30 (the LR of
    the warmup's steps does not depend on the count), or step 30 where the warmup ends before
    step START + MIN_TIMED."""
    last_of_warmup = warmup_steps - 1
    return min(AT, last_of_warmup) if last_of_warmup >= START + MIN_TIMED else AT


def steps_for(minutes: float, spent_s: float, step: int, step_s: float, cap: int) -> int:
    """The step count `minutes` buy: `step` done after `spent_s` seconds, then `step_s` a
    step for the rest; at least one step more than `step`, at most `cap`."""
    left = minutes * 60.0 - spent_s
    return min(cap, step + max(1, math.floor(left / step_s)))


class StepsForTime(pl.Callback):
    """Fix the run's step count (see the module's doc); `clock` is for tests."""

    def __init__(
        self,
        minutes: float,
        cap: int,
        warmup_steps: int,
        clock: Callable[[], float] | None = None,
    ):
        self.minutes, self.cap, self.warmup_steps = minutes, cap, warmup_steps
        self.at = fix_step(warmup_steps)
        self.clock = clock or _now
        self.steps: int | None = None  # the fixed step count
        self.step_s: float | None = None  # the measured seconds a step
        self.fixed_at: int | None = None  # the step that fixed it
        self.spent_s = 0.0  # seconds trained by earlier processes of this run (before a kill)
        self.saved_minutes: float | None = None  # the budget a resumed run was started with
        self._t0: float | None = None
        self._val_s = 0.0  # seconds of validation since _t0
        self._v0: float | None = None
        self._mark: tuple[float, float, int] | None = None  # (clock, _val_s, step)
        self._first_step = 0

    # -- checkpointed state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "minutes": self.minutes,
            "steps": self.steps,
            "step_s": self.step_s,
            "fixed_at": self.fixed_at,
            "spent_s": self._spent(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = state_dict.get("steps")
        self.step_s = state_dict.get("step_s")
        self.fixed_at = state_dict.get("fixed_at")
        self.spent_s = float(state_dict.get("spent_s") or 0.0)
        self.saved_minutes = state_dict.get("minutes")

    def _spent(self) -> float:
        """Seconds of training (validation left out) over every process of the run."""
        if self._t0 is None:
            return self.spent_s
        return self.spent_s + (self.clock() - self._t0 - self._val_s)

    # -- hooks ------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._val_s, self._mark = self.clock(), 0.0, None
        self._first_step = trainer.global_step
        if self.steps is not None:
            self._resumed(trainer, pl_module)
        elif self.cap <= self.at:
            log.warning(
                "max_minutes=%g has no effect: trainer.max_steps=%d ends the run before step "
                "%d, where the budget would fix the step count",
                self.minutes,
                self.cap,
                self.at,
            )
        elif self.at >= self.warmup_steps:
            log.warning(
                "max_minutes=%g with optim.warmup_steps=%d: the LR of steps %d-%d follows a "
                "schedule as long as trainer.max_steps (%d), as the count is fixed at step %d; "
                "optim.warmup_steps >= %d avoids it",
                self.minutes,
                self.warmup_steps,
                self.warmup_steps,
                self.at,
                self.cap,
                self.at,
                START + MIN_TIMED + 1,
            )

    def _resumed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = min(self.steps, self.cap)
        if self.saved_minutes is not None and self.saved_minutes != self.minutes:
            log.warning(
                "max_minutes=%g, but the run being resumed fixed its step count under "
                "max_minutes=%g: it keeps that count (%d); a new out= fits a new one",
                self.minutes,
                self.saved_minutes,
                self.steps,
            )
        if steps < self.steps:
            log.warning(
                "trainer.max_steps=%d is below the %d steps the run fixed for its budget: "
                "it ends at %d",
                self.cap,
                self.steps,
                steps,
            )
        self.steps = steps
        self._apply(trainer, pl_module, steps)
        log.info(
            "max_minutes=%g: %d steps, as fixed at step %s before the run was resumed",
            self.minutes,
            steps,
            self.fixed_at,
        )

    def on_validation_start(self, trainer, pl_module) -> None:
        self._v0 = self.clock() if self._t0 is not None else None

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._v0 is not None:
            self._val_s += self.clock() - self._v0
            self._v0 = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps is not None or self.cap <= self.at:
            return
        step = trainer.global_step
        if self._mark is None:
            # a resumed process, too, leaves its first START steps untimed
            if step >= self._first_step + START:
                self._mark = (self.clock(), self._val_s, step)
            return
        t_mark, val_mark, step_mark = self._mark
        if step < self.at or step - step_mark < self.at - START:
            return
        now = self.clock()
        step_s = (now - t_mark - (self._val_s - val_mark)) / (step - step_mark)
        steps = steps_for(self.minutes, self._spent(), step, step_s, self.cap)
        # every rank must stop at the same step: rank 0's measurement decides
        steps, step_s = trainer.strategy.broadcast((steps, step_s))
        self.steps, self.step_s, self.fixed_at = int(steps), float(step_s), step
        self._apply(trainer, pl_module, self.steps)
        log.info(
            "max_minutes=%g: %.3f s a step over steps %d-%d -> %d steps in all%s",
            self.minutes,
            self.step_s,
            step_mark,
            step,
            self.steps,
            " (trainer.max_steps, the cap)" if self.steps == self.cap else "",
        )
        if self.steps <= self.warmup_steps:
            log.warning(
                "the budget buys %d steps, no more than optim.warmup_steps=%d: the LR never "
                "decays; raise max_minutes or lower the warmup",
                self.steps,
                self.warmup_steps,
            )

    @staticmethod
    def _apply(trainer: pl.Trainer, pl_module: pl.LightningModule, steps: int) -> None:
        trainer.fit_loop.epoch_loop.max_steps = steps
        pl_module.max_steps = steps  # the LR schedule's length (lr_factor's total)

    def summary(self) -> dict:
        return {
            "max_minutes": self.minutes,
            "steps": self.steps,
            "step_s": None if self.step_s is None else round(self.step_s, 4),
            "fixed_at_step": self.fixed_at,
            "cap": self.cap,
        }
