"""Which committed steps to delete after a new commit (pure function, easy to test).

Policy (the same as Orbax's ``max_to_keep`` + ``keep_period``):

* the newest ``max_to_keep`` complete steps are kept (``None``: keep everything);
* older steps that are multiples of ``keep_every_n_steps`` are kept forever;
* the newest complete step is never deleted, whatever the settings;
* it runs only *after* a new step is committed, so a crash during retention never
  leaves fewer complete checkpoints than the policy asks for.
"""

from __future__ import annotations

from typing import Iterable


def validate(max_to_keep: int | None, keep_every_n_steps: int | None) -> None:
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
        raise ValueError(f"max_to_keep must be None or an int >= 1, got {max_to_keep!r}")
    if keep_every_n_steps is not None and (not isinstance(keep_every_n_steps, int)
                                           or keep_every_n_steps < 1):
        raise ValueError(f"keep_every_n_steps must be None or an int >= 1, got {keep_every_n_steps!r}")


def steps_to_delete(complete_steps: Iterable[int], *, max_to_keep: int | None,
                    keep_every_n_steps: int | None, protected: Iterable[int] = ()) -> list[int]:
    """Steps to delete, oldest first. ``protected`` steps are never returned."""
    steps = sorted(set(complete_steps))
    if max_to_keep is None or len(steps) <= max_to_keep:
        return []
    keep = set(steps[-max_to_keep:]) | {steps[-1]} | set(protected)
    if keep_every_n_steps:
        keep |= {s for s in steps if s % keep_every_n_steps == 0}
    return [s for s in steps if s not in keep]
