"""Linear learning-rate scaling with gradual warm-up by worker count (Goyal et al. 2017, "Accurate,
Large Minibatch SGD"; what the P3 article did when it grew the cluster). Framework-neutral, no imports.
"""

from __future__ import annotations

__all__ = ["scaled_learning_rate"]


def scaled_learning_rate(base_lr: float, *, num_workers: int, step: int, warmup_steps: int = 0,
                         reference_workers: int = 1, warmup_start_step: int = 0) -> float:
    """The learning rate at global ``step`` when each worker adds its own batch to the global batch.

    target = ``base_lr * num_workers / reference_workers`` (the global batch grew by that factor).
    For ``warmup_steps`` steps after ``warmup_start_step`` the rate ramps linearly from ``base_lr`` to
    the target; afterwards (and before ``warmup_start_step``) it is the target. Source: Goyal et al. 2017,
    "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (linear scaling rule, gradual warm-up).

    Args:
        base_lr: the learning rate for ``reference_workers`` workers, > 0.
        num_workers: workers in the current group, >= 1.
        step: the 0-based global optimizer step, >= 0.
        warmup_steps: optimizer steps of the ramp, >= 0 (default 0: no ramp).
        reference_workers: the worker count ``base_lr`` was tuned for, >= 1 (default 1).
        warmup_start_step: the step the ramp begins at, >= 0 (e.g. the first step of a generation that
            changed the worker count; default 0).

    Returns:
        the learning rate for ``step``.

    Raises:
        ValueError: naming the value, for ``base_lr`` <= 0, a worker count < 1, or a negative or
            non-integer step count.
    """
    for name, value, low in (("num_workers", num_workers, 1), ("reference_workers", reference_workers, 1),
                             ("step", step, 0), ("warmup_steps", warmup_steps, 0),
                             ("warmup_start_step", warmup_start_step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}. Received: {name}={value!r}")
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0. Received: base_lr={base_lr!r}")
    target = base_lr * num_workers / reference_workers
    done = step - warmup_start_step
    if warmup_steps == 0 or done >= warmup_steps or done < 0:
        return target
    return base_lr + (target - base_lr) * (done + 1) / warmup_steps
