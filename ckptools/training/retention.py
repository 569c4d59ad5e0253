"""Which checkpoints a retention policy keeps: a pure function of steps and metrics.

No disk, no torch: :class:`CheckpointManager` and ``ckpt prune`` both call :func:`plan_retention`
with the complete checkpoints they found, then delete what it says, so the policy can be tested on
its own (hypothesis properties in ``tests/unit/test_retention.py``).

A checkpoint is kept when any rule keeps it:

* the newest complete checkpoint, always (so a resume point survives any policy);
* ``keep_last``: the newest N;
* ``keep_every``: every step divisible by K (long-term snapshots);
* ``keep_best``: the N best by ``metric`` (``mode`` ``"min"`` or ``"max"``); checkpoints without a
  finite value for the metric never count as best; ties go to the newer step.

Example:
    >>> from ckptools.training.retention import RetentionPolicy, plan_retention
    >>> plan_retention({10: {}, 20: {}, 30: {}}, RetentionPolicy(keep_last=2)).delete
    (10,)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ckptools.errors import UsageError

__all__ = ["RetentionDecision", "RetentionPolicy", "plan_retention"]

Mode = Literal["min", "max"]


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep. ``None`` disables a rule; with every rule disabled everything is kept.

    Attributes:
        keep_last: keep the newest N complete checkpoints (N >= 1).
        keep_every: keep every checkpoint whose step is a multiple of K (K >= 1).
        keep_best: keep the N best by ``metric`` (N >= 1; needs ``metric``).
        metric: name of the metric recorded at save time (``metrics={"loss": ...}``).
        mode: ``"min"`` when lower is better, ``"max"`` when higher is.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Mode = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise UsageError(
                    f"{name} must be a positive integer or None, got {value!r}; "
                    "use None to disable the rule"
                )
        if self.keep_best is not None and not self.metric:
            raise UsageError("keep_best needs metric=<name of a metric passed to save(metrics=)>")
        if self.mode not in ("min", "max"):
            raise UsageError(f"mode must be 'min' or 'max', got {self.mode!r}")

    @property
    def deletes_anything(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


@dataclass(frozen=True)
class RetentionDecision:
    """The outcome of :func:`plan_retention`.

    Attributes:
        keep: steps kept, ascending.
        delete: steps to delete, ascending.
        reasons: for each kept step, the rules that keep it (``"newest"``, ``"last"``,
            ``"every"``, ``"best"``, ``"no-policy"``).
    """

    keep: tuple[int, ...]
    delete: tuple[int, ...]
    reasons: Mapping[int, tuple[str, ...]]


def _metric_value(metrics: Mapping[str, object], name: str) -> float | None:
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def plan_retention(
    checkpoints: Mapping[int, Mapping[str, object]], policy: RetentionPolicy
) -> RetentionDecision:
    """Decide which complete checkpoints to keep.

    Args:
        checkpoints: step -> metrics recorded for that step (may be empty), complete ones only.
        policy: the rules.

    Returns:
        The steps to keep and to delete, and why each kept step is kept.

    Example:
        >>> from ckptools.training.retention import RetentionPolicy, plan_retention
        >>> ckpts = {1: {"loss": 3.0}, 2: {"loss": 1.0}, 3: {"loss": 2.0}, 4: {"loss": 5.0}}
        >>> policy = RetentionPolicy(keep_last=1, keep_best=1, metric="loss")
        >>> plan_retention(ckpts, policy).keep
        (2, 4)
    """
    steps = sorted(checkpoints)
    reasons: dict[int, list[str]] = {s: [] for s in steps}
    if not steps:
        return RetentionDecision(keep=(), delete=(), reasons={})
    reasons[steps[-1]].append("newest")
    if not policy.deletes_anything:
        for s in steps:
            reasons[s].append("no-policy")
    if policy.keep_last is not None:
        for s in steps[-policy.keep_last :]:
            reasons[s].append("last")
    if policy.keep_every is not None:
        for s in steps:
            if s % policy.keep_every == 0:
                reasons[s].append("every")
    if policy.keep_best is not None and policy.metric is not None:
        scored = [
            (value, s)
            for s in steps
            if (value := _metric_value(checkpoints[s], policy.metric)) is not None
        ]
        # Best first; among equal values the newer step wins (it has seen more training).
        sign = 1.0 if policy.mode == "min" else -1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        for _, s in scored[: policy.keep_best]:
            reasons[s].append("best")
    keep = tuple(s for s in steps if reasons[s])
    delete = tuple(s for s in steps if not reasons[s])
    return RetentionDecision(keep=keep, delete=delete, reasons={s: tuple(reasons[s]) for s in keep})
