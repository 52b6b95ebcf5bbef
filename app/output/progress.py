"""Rank 0's progress line: how close the run is to what will end it.

A run ends when the mean return of the last ``window`` episodes reaches the target, or when the
step budget is spent. The line follows the rule that can end the run: the target when one is set
and reachable (the fraction of it reached now, which falls when the return falls), otherwise the
budget. In a terminal it is one tqdm bar redrawn in place; elsewhere (CI, a log file) it is a
plain line every few seconds, without carriage returns.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from app.output.logs import bar_on_screen, write_console

PLAIN_INTERVAL_S = 5.0  # between plain lines when the console is not a terminal
BAR_INTERVAL_S = 0.5  # between redraws of the bar in a terminal
_STEPS = 1000  # the bar's resolution: a fraction is drawn as n / _STEPS


@dataclass(frozen=True)
class StopRule:
    """What ends the run: a target for the mean return of the last ``window`` episodes, unless
    it is None, and a budget of env steps."""

    target_return: float | None
    window: int
    total_env_steps: int
    on_eval: bool = False  # the target is compared with the last evaluation's mean return

    @property
    def by_target(self) -> bool:
        return self.target_return is not None

    def fraction(self, mean_return: float, env_steps: int) -> float:
        """Progress toward the rule that ends the run, in [0, 1]; 1 exactly when it fires."""
        if self.target_return is not None:
            if mean_return >= self.target_return:
                return 1.0
            if not math.isfinite(mean_return):
                return 0.0
            if self.target_return <= 0:  # a share of a negative target means nothing: budget
                return min(env_steps / self.total_env_steps, 0.999)
            return min(max(mean_return / self.target_return, 0.0), 1.0)
        return min(env_steps / self.total_env_steps, 1.0)


@dataclass(frozen=True)
class Snapshot:
    """The figures the line shows after one update."""

    env_steps: int
    mean_return: float  # of the last `window` episodes; -inf until `window` have finished
    episodes: int
    env_steps_per_s: float
    weights_version: int
    elapsed_s: float
    members: int | None = None  # live rollout ranks of an elastic run (None: not elastic)
    eval_return: float | None = None  # the last evaluation's mean return (loop.eval_every)
    eval_version: int | None = None  # the weights version it evaluated
    replay_size: int | None = None  # an off-policy run's replay: transitions per trainer shard
    samples_per_insert: float | None = None  # the ratio the replay held
    # Seconds collectors and learner waited on the replay's rate limiter (this attempt's).
    limiter_wait_s: tuple[float, float] | None = None
    waiting: bool = False  # trainers wait for rollout ranks to join


class _Bar(tqdm):
    """A tqdm bar whose right-hand text is ours ("{right}" in the bar format)."""

    right = ""

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, "right": self.right}


class RunProgress:
    """Shows a run's progress on ``stream`` (rank 0's console)."""

    def __init__(
        self,
        rule: StopRule,
        name: str = "ppo",
        stream: TextIO | None = None,
        plain_interval_s: float = PLAIN_INTERVAL_S,
    ) -> None:
        self.rule, self.name = rule, name
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = _is_terminal(self.stream)
        self.interval_s = BAR_INTERVAL_S if self.terminal else plain_interval_s
        self._last_draw = -math.inf
        self._last: Snapshot | None = None
        self._drawn: Snapshot | None = None
        self._bar: _Bar | None = None
        if self.terminal:
            # tqdm's default lock is a multiprocessing semaphore, which a process stopped by a
            # signal leaks (with a warning from the resource tracker); one thread lock will do.
            tqdm.set_lock(threading.RLock())
            self._bar = _Bar(
                total=_STEPS,
                file=self.stream,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {right}",
                dynamic_ncols=True,
                leave=True,
            )
            bar_on_screen(True)

    def update(self, now: Snapshot) -> None:
        """Record one update; redraws when enough time has passed since the last drawing."""
        self._last = now
        if time.monotonic() - self._last_draw >= self.interval_s:
            self._draw(now)

    def waiting(self, text: str) -> None:
        """The run waits for something (rollout ranks to join): shown at once, until the next
        update redraws the line."""
        if self._bar is None:
            write_console(f"[rank0] {self.name}: {text}", self.stream)
            return
        self._bar.right = text
        self._bar.refresh()
        self._last_draw = -math.inf  # the next update redraws

    def close(self) -> None:
        """Draws the final state (100% when the stop rule fired) and leaves it on screen."""
        if self._last is not None and self._last is not self._drawn:
            self._draw(self._last)
        if self._bar is not None:
            self._bar.close()
            bar_on_screen(False)

    def _draw(self, now: Snapshot) -> None:
        self._last_draw, self._drawn = time.monotonic(), now
        quantity = now.mean_return
        if self.rule.on_eval:
            quantity = now.eval_return if now.eval_return is not None else -math.inf
        fraction = self.rule.fraction(quantity, now.env_steps)
        left, right = self._texts(now)
        if self._bar is None:
            write_console(f"{left} {fraction:4.0%} | {right}", self.stream)
            return
        self._bar.set_description_str(left, refresh=False)
        self._bar.right = right
        self._bar.n = round(fraction * _STEPS)
        self._bar.refresh()

    def _texts(self, now: Snapshot) -> tuple[str, str]:
        rule = self.rule
        full = math.isfinite(now.mean_return)  # `window` episodes have finished
        mean = f"{now.mean_return:.1f}" if full else "--"
        count = f"last {rule.window}" if full else f"{now.episodes}/{rule.window} episodes"
        rate = f"{now.env_steps_per_s:,.0f} steps/s"
        clock = f"weights v{now.weights_version}, {_clock(now.elapsed_s)}"
        if now.members is not None:
            clock = f"{now.members} rollout ranks, {clock}"
        if now.eval_return is not None:
            rate = f"eval {now.eval_return:.1f} (v{now.eval_version}), {rate}"
        if now.replay_size is not None:
            waits = (f", limiter waits {now.limiter_wait_s[0]:.1f} s collectors "
                     f"{now.limiter_wait_s[1]:.1f} s learner"
                     if now.limiter_wait_s is not None else "")
            rate = (f"replay {now.replay_size:,} at {now.samples_per_insert or 0:.1f} "
                    f"samples/insert{waits}, {rate}")
        if rule.target_return is not None and rule.on_eval:
            shown = f"{now.eval_return:.1f}" if now.eval_return is not None else "--"
            left = f"[rank0] {self.name}: eval return {shown} of {rule.target_return:g}"
            return left, f"train {mean} ({count}), {now.env_steps:,} env steps, {rate}, {clock}"
        if rule.target_return is not None:
            left = f"[rank0] {self.name}: mean return {mean} of {rule.target_return:g}"
            right = f"{now.env_steps:,} env steps, {rate}, {clock}"
            if not full:
                right = f"{count}, {right}"
            return left, right
        left = f"[rank0] {self.name}: {now.env_steps:,} of {rule.total_env_steps:,} env steps"
        right = f"mean return {mean} ({count}), {rate}, {clock}"
        if now.env_steps_per_s > 0 and now.env_steps < rule.total_env_steps:
            right += f", ~{_clock((rule.total_env_steps - now.env_steps) / now.env_steps_per_s)} left"
        return left, right


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
