"""Linear learning-rate scaling with gradual warm-up by worker count (Goyal et al. 2017, "Accurate,
Large Minibatch SGD"; what the P3 article did when it grew the cluster). Framework-neutral, no imports.
"""

from __future__ import annotations

__all__ = ["scaled_learning_rate"]


def scaled_learning_rate(base_lr: float, *, num_workers: int, step: int, warmup_steps: int = 0,
                         reference_workers: int = 1, warmup_start_step: int = 0) -> float:
    """The learning rate at global ``step`` when each worker adds its own batch to the global batch.

    target = ``base_lr * num_workers / reference_workers`` (the global batch grew by that factor).
    For ``warmup_steps`` steps after ``warmup_start_step`` (e.g. the first step of a generation that
    changed the worker count) the rate ramps linearly from ``base_lr`` to the target; afterwards it
    is the target. Units: ``step`` and ``warmup_steps`` in optimizer steps.

    Raises ValueError (naming the value) for base_lr <= 0, num_workers/reference_workers < 1,
    negative step/warmup_steps.
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
