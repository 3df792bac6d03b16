"""Cost model for checkpoint stalls and the automatic choice of the window size K.

Why a model at all: the right K depends on numbers the user rarely knows up front
(how long a step computes, how fast the device->host link is, how big the state and
the gradient are). Picking K by hand invites either stalls (K too small: a slice does
not hide under one step) or needless traffic and host work (K too large: every extra
step of the window re-ships gradient slices). The functions here are pure, cheap and
deterministic, so a trainer can call :func:`choose_k` once at start-up (with a
measured bandwidth from
:func:`overlap_ckpt.costmodel.hardware.measure_d2h_bandwidth`) and a planner can compare
strategies before buying hardware (:mod:`overlap_ckpt.tools.simulate`).

Strategies modelled (stall = training time lost per checkpoint):

``"sync"``
    Blocking save: copy the whole state device->host, then persist it, then resume.
    ``stall = S/bw + S/persist_bw``.
``"async"``
    Snapshot then persist in the background (what Orbax's async checkpointer does):
    training waits only for the device->host copy. ``stall = S/bw``.
``"overlap"`` with ``k=1``
    The copy of the full state is issued asynchronously and hides under one step's
    overlappable compute: ``stall = max(0, S/bw - f*T)``.
``"overlap"`` with ``k=K>1``
    GoCkpt-style: the state is cut into K slices shipped over K consecutive steps,
    together with the gradient slices that already-shipped slices need, and the host
    replays the optimizer to bring every slice to the same version. The slices are sized
    so that every step ships the same bytes (see :func:`window_transfer_bytes`).

Notation used throughout: ``S`` state bytes (params + optimizer state, per
accelerator), ``G`` bytes of one step's full gradient (per accelerator), ``bw`` the
device->host bandwidth, ``T`` the step time, ``f`` the overlappable fraction, so the
per-step overlap window is ``f*T`` seconds and the per-step transfer budget is
``B = f*T*bw`` bytes.

Assumptions (deliberate simplifications; override the inputs rather than the code):

* copies that fit in the overlap window cost nothing (the copy engines run beside the
  compute and do not slow it; HBM-bandwidth contention is ignored), and bytes that do
  not fit stall the step they belong to (they do not spill into the next step's
  budget);
* the state has the same bytes per parameter everywhere (true for mixed-precision
  Adam), so a slice of a fraction of the state owns that fraction of the gradient, and
  slices are sized exactly as :func:`overlap_ckpt.core.slicing.slice_shares` says; real
  slices are cut at rows or leaves and only approximately so;
* one checkpoint is in flight at a time: a checkpoint's background work (host replay
  and persist) must finish before the next one starts capturing, or the next capture
  waits (the same rule Orbax applies when a new save finds the previous one running).
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Any, Literal

import numpy as np

from ..core.slicing import step_copy_share

Strategy = Literal["sync", "async", "overlap"]
STRATEGIES: tuple[str, ...] = ("sync", "async", "overlap")

GB = 1e9  # decimal gigabyte: bandwidths in GB/s below are 1e9 bytes per second


# --------------------------------------------------------------------------- validation


def check_number(name: str, value: Any, *, positive: bool = False,
                  nonnegative: bool = False) -> float:
    """Reject non-numbers, bools, NaN and infinities with a message naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Window sizes and intervals are counts of steps: whole numbers, at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_strategy(strategy: Any) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


# --------------------------------------------------------------------------- profile


@dataclasses.dataclass(frozen=True)
class TrainingProfile:
    """What the cost model needs to know about one accelerator's training step.

    All byte counts are *per accelerator* (with FSDP/ZeRO sharding, the shard this
    device holds), because each device copies over its own link.

    Attributes:
        step_time_s: wall time of one training step without checkpointing.
        d2h_bytes_per_s: device->host copy bandwidth (measure it with
            :func:`overlap_ckpt.costmodel.hardware.measure_d2h_bandwidth`; pinned-host
            copies are what overlap uses).
        state_bytes: bytes of params + optimizer state to checkpoint.
        grad_bytes: bytes of one step's full gradient (same sharding as the params).
        persist_bytes_per_s: host->storage bandwidth available to this accelerator's
            checkpoint (a node's NVMe is shared by its accelerators).
        overlappable_fraction: fraction of the step a copy can hide under. Less than 1
            because the copy can only start once the data it reads is final and must
            finish before the buffers are donated/overwritten; 0.9 is a reasonable
            default for GPU steps dominated by matmuls, ~0 on the CPU backend where
            copies and compute share the same cores and memory bus.
        replay_bytes_per_s: host throughput of one optimizer replay step, in bytes of
            state updated per second; ``None`` means replay time is not modelled
            (counted as 0). Only affects the background time of ``"overlap"``.
        schedule_capacity_bytes: the bytes of its host copies a compiled window step
            overlapped, where its schedule serialized the rest (issued them with nothing
            computing while they transfer); ``None`` where no schedule was read or it
            serialized nothing that counts. Why a cap beside ``f``: XLA:TPU keeps only a
            few host copies in flight, so a step with more copies than its compute covers
            a few at a time serializes bytes a time budget says would hide (the 100M LM at
            2 sequences per v5e chip: 38 copies of 2.2 MiB at K=1, none at K=2).
    """

    step_time_s: float
    d2h_bytes_per_s: float
    state_bytes: float
    grad_bytes: float
    persist_bytes_per_s: float
    overlappable_fraction: float = 0.9
    replay_bytes_per_s: float | None = None
    schedule_capacity_bytes: float | None = None

    def __post_init__(self) -> None:
        check_number("step_time_s", self.step_time_s, positive=True)
        check_number("d2h_bytes_per_s", self.d2h_bytes_per_s, positive=True)
        check_number("state_bytes", self.state_bytes, positive=True)
        check_number("grad_bytes", self.grad_bytes, nonnegative=True)
        check_number("persist_bytes_per_s", self.persist_bytes_per_s, positive=True)
        f = check_number("overlappable_fraction", self.overlappable_fraction,
                          nonnegative=True)
        if f > 1:
            raise ValueError(
                f"overlappable_fraction is a fraction of the step time and must be in "
                f"[0, 1], got {f!r}")
        if self.replay_bytes_per_s is not None:
            check_number("replay_bytes_per_s", self.replay_bytes_per_s, positive=True)
        if self.schedule_capacity_bytes is not None:
            check_number("schedule_capacity_bytes", self.schedule_capacity_bytes, nonnegative=True)

    @property
    def overlap_s(self) -> float:
        """Seconds per step under which a copy can hide: ``f * T``."""
        return self.overlappable_fraction * self.step_time_s

    @property
    def transfer_budget_bytes(self) -> float:
        """Bytes one step can hide: ``B = f * T * bw``, at most what a compiled step's
        schedule overlapped where it serialized the rest (``schedule_capacity_bytes``)."""
        budget = self.overlap_s * self.d2h_bytes_per_s
        if self.schedule_capacity_bytes is None:
            return budget
        return min(budget, self.schedule_capacity_bytes)

    @property
    def full_copy_s(self) -> float:
        """Seconds to copy the whole state device->host in one go: ``S / bw``."""
        return self.state_bytes / self.d2h_bytes_per_s

    @property
    def persist_s(self) -> float:
        """Seconds to write the whole state from host to storage: ``S / persist_bw``."""
        return self.state_bytes / self.persist_bytes_per_s


# --------------------------------------------------------------------------- the window


def predicted_step_time_s(flops: float, peak_flops: float, mfu: float, hbm_bytes: float | None = None,
                          hbm_bytes_per_s: float | None = None) -> float:
    """Step time of a compiled step on hardware it has not run on: its flops at ``mfu`` of
    the peak rate, or its memory traffic at the HBM bandwidth when that takes longer
    (``hbm_bytes`` only from an optimized program: before fusion every intermediate counts)."""
    t = check_number("flops", flops, positive=True) / (check_number("peak_flops", peak_flops, positive=True)
                                                       * check_number("mfu", mfu, positive=True))
    if hbm_bytes and hbm_bytes_per_s:
        t = max(t, hbm_bytes / hbm_bytes_per_s)
    return t


def window_transfer_bytes(state_bytes: float, grad_bytes: float, k: int) -> list[float]:
    """Bytes shipped device->host at each step ``j = 0..k-1`` of a K-step window.

    Derivation. The window covers steps ``V-K+1 .. V`` and the checkpoint is the state
    at version ``V``. Slice ``i`` (a fraction ``s_i`` of the state) is captured at step
    ``V-K+1+i``, so the host must apply that step's gradient and the later ones up to
    ``V-1`` to it (``K-1-i`` of them); slice ``K-1`` needs none. Each step's program
    ships its own gradient (it exists only once the backward pass ran), restricted to
    the slices captured so far, so step ``j < K-1`` ships ``S*s_j + G*(s_0 + .. + s_j)``
    and the last step ``S*s_{K-1}``.

    With K equal slices that grows with ``j`` (``S/K + (j+1)G/K``, peaking near
    ``S/K + G``), and the largest step sets the stall. The engine sizes the slices so
    that every step ships the same bytes instead
    (:func:`overlap_ckpt.core.slicing.slice_shares`, ``g = G/S``): ``c*S`` each, with
    ``c`` = :func:`overlap_ckpt.core.slicing.step_copy_share`, and ``K*c*S`` in all. As
    K grows, ``c*S`` falls towards ``S*G/(S+G)``: a step always carries the gradient rows
    of the slices before it. What the model does not see is that a gradient copy can only
    start once the backward pass has produced it, so its real hiding window is shorter
    than ``f*T``; lower ``overlappable_fraction`` if measured stalls exceed predictions.
    """
    k = check_int("k", k)
    state_bytes = check_number("state_bytes", state_bytes, nonnegative=True)
    grad_bytes = check_number("grad_bytes", grad_bytes, nonnegative=True)
    return [_step_bytes(state_bytes, grad_bytes, k)] * k


def _step_bytes(state_bytes: float, grad_bytes: float, k: int) -> float:
    if state_bytes == 0:
        return 0.0
    return state_bytes * step_copy_share(k, grad_bytes / state_bytes)


def min_zero_stall_k(profile: TrainingProfile) -> int | None:
    """Smallest K whose window steps each fit the per-step budget ``B``, or ``None``.

    A step ships ``c(K)*S`` (:func:`window_transfer_bytes`), falling with K towards
    ``S*G/(S+G)``: so K=1 when ``S <= B``, no K at all when ``B <= S*G/(S+G)``, and
    otherwise, with ``g = G/S``, the smallest K with
    ``(1+g)^-(K-1) <= 1 - g*(S/B - 1)``. Mixed-precision Adam (16 B of state and a bf16
    gradient of 2 B per parameter) with a budget of twice the gradient needs K=5 (equal
    slices needed 7, GoCkpt's choice).
    """
    s, g_bytes, b = profile.state_bytes, profile.grad_bytes, profile.transfer_budget_bytes
    if s <= b:
        return 1
    g = g_bytes / s
    if b * (1 + g) <= s * g:
        return None
    # In rationals: with a budget near zero (a subnormal fraction of the step) S/B and the
    # K below overflow a float; K is then astronomic, but still the answer.
    if g == 0:  # equal slices: K >= S/B, exactly
        return math.ceil(fractions.Fraction(s) / fractions.Fraction(b))
    # g*(S/B - 1) written as G/B - g, which stays below 1 where S/B overflows.
    k = 1 + math.ceil(fractions.Fraction(-math.log1p(-(g_bytes / b - g))) / fractions.Fraction(math.log1p(g)))
    if k > 2**53:  # beyond a float's integers, where the check below cannot tell K from K-1
        return k
    # The float estimate can be one off on the boundary: settle it on the definition.
    for _ in range(4):
        if k > 1 and _step_bytes(s, g_bytes, k - 1) <= b:
            k -= 1
        elif _step_bytes(s, g_bytes, k) > b:
            k += 1
        else:
            break
    return k


# --------------------------------------------------------------------------- predictions


def predict_stall_s(profile: TrainingProfile, strategy: Strategy, k: int = 1) -> float:
    """Seconds of training stall caused by one checkpoint.

    ``"sync"``: ``S/bw + S/persist_bw`` (copy then write, both blocking).
    ``"async"``: ``S/bw`` (blocking snapshot; persist happens in the background).
    ``"overlap"``: ``sum_j max(0, transfer_j/bw - f*T)`` over the K window steps, each
    shipping the same ``transfer_j`` (:func:`window_transfer_bytes`). For K=1 this is
    ``max(0, S/bw - f*T)``. ``k`` is ignored by the other strategies.
    """
    strategy = _check_strategy(strategy)
    k = check_int("k", k)
    if strategy == "sync":
        return profile.full_copy_s + profile.persist_s
    if strategy == "async":
        return profile.full_copy_s
    return _overlap_stall_s(profile, k)


def _overlap_stall_s(profile: TrainingProfile, k: int) -> float:
    """``k * max(0, c*S/bw - f*T)``: every window step ships the same ``c*S`` bytes."""
    excess = _step_bytes(profile.state_bytes, profile.grad_bytes, k) - profile.transfer_budget_bytes
    return k * max(0.0, excess) / profile.d2h_bytes_per_s


def predict_background_s(profile: TrainingProfile, strategy: Strategy, k: int = 1) -> float:
    """Seconds of host work after capture that must end before the next capture.

    ``"sync"``: 0 (the persist is inside the stall). ``"async"``: ``S/persist_bw``.
    ``"overlap"``: replay + persist. Slice ``i`` needs ``K-1-i`` optimizer steps, so the
    replay processes ``S * sum_i s_i (K-1-i)`` bytes, and each of those steps' gradient
    rows was shipped once: ``G`` times the same sum is what the window ships beyond the
    state, ``(K*c - 1)*S``. Hence ``S*(K*c - 1)/g`` bytes of replay (``S(K-1)/2`` with
    equal slices when ``g = 0``), taking that over ``replay_bw`` (0 when
    ``replay_bytes_per_s`` is None).
    """
    strategy = _check_strategy(strategy)
    k = check_int("k", k)
    if strategy == "sync":
        return 0.0
    if strategy == "async":
        return profile.persist_s
    replay = 0.0
    if profile.replay_bytes_per_s is not None:
        replay = replayed_bytes(profile.state_bytes, profile.grad_bytes, k) / profile.replay_bytes_per_s
    return replay + profile.persist_s


def replayed_bytes(state_bytes: float, grad_bytes: float, k: int) -> float:
    """State bytes the host replay updates per window (see :func:`predict_background_s`)."""
    if k == 1 or state_bytes == 0:
        return 0.0
    g = grad_bytes / state_bytes
    if g < 1e-9:  # (K*c - 1)/g loses its digits; equal slices are the limit
        return state_bytes * (k - 1) / 2
    return state_bytes * (k * step_copy_share(k, g) - 1) / g


@dataclasses.dataclass(frozen=True)
class CheckpointEstimate:
    """Breakdown of one checkpoint cycle of ``interval_steps`` steps.

    ``ettr = useful / (useful + stall + queue_wait)`` with ``useful = N*T``.
    """

    strategy: str
    k: int
    interval_steps: int
    stall_s: float
    background_s: float
    queue_wait_s: float
    ettr: float

    @property
    def overhead_s(self) -> float:
        """Training time lost per checkpoint: stall plus waiting for the previous one."""
        return self.stall_s + self.queue_wait_s


def estimate(profile: TrainingProfile, strategy: Strategy, k: int,
             interval_steps: int) -> CheckpointEstimate:
    """Stall, background time, queueing and ETTR for a checkpoint every N steps.

    The background work of a checkpoint has a gap of training time to finish in before
    the next capture begins: ``N*T`` for ``"async"`` (capture happens between steps,
    then N steps run), ``(N-K)*T`` for ``"overlap"`` (background work can only start
    once the last slice and gradient have arrived at the end of the window, and the
    next window starts ``N-K`` steps later). Work longer than the gap delays the next
    capture: ``queue_wait = max(0, background - gap)``. In steady state every cycle
    pays it, so it counts as lost training time just like the stall.

    Raises ValueError if ``k > interval_steps`` for ``"overlap"``: consecutive
    windows would overlap, and the state would be in two checkpoints' windows at once.
    """
    strategy = _check_strategy(strategy)
    k = check_int("k", k)
    n = check_int("interval_steps", interval_steps)
    if strategy == "overlap" and k > n:
        raise ValueError(
            f"window size k={k} exceeds the checkpoint interval of {n} steps: a K-step "
            f"window must end before the next checkpoint's window starts (use k <= {n})")
    stall = predict_stall_s(profile, strategy, k)
    background = predict_background_s(profile, strategy, k)
    gap_steps = n - k if strategy == "overlap" else n
    wait = max(0.0, background - gap_steps * profile.step_time_s)
    useful = n * profile.step_time_s
    ettr = useful / (useful + stall + wait)
    return CheckpointEstimate(strategy, k if strategy == "overlap" else 1, n,
                              stall, background, wait, ettr)


def predict_ettr(profile: TrainingProfile, strategy: Strategy, k: int,
                 interval_steps: int) -> float:
    """Effective training time ratio with one checkpoint every ``interval_steps`` steps.

    ``ETTR = N*T / (N*T + stall + queue_wait)``; see :func:`estimate` for the queueing
    rule. Only checkpoint overhead is counted (not work lost to failures), so it is 1
    for a free checkpoint and falls towards 0 as checkpoints dominate.
    """
    return estimate(profile, strategy, k, interval_steps).ettr


def choose_k(profile: TrainingProfile, max_k: int = 16, interval_steps: int | None = None,
             *, rel_tol: float = 1e-9) -> int:
    """The smallest window size K in ``1..max_k`` minimising the predicted cost.

    Without ``interval_steps`` the cost is the stall of :func:`predict_stall_s`. With
    it, K is also clamped to ``interval_steps`` (a window cannot be longer than the
    gap between checkpoints) and the cost is the stall plus the queueing wait of
    :func:`estimate`, i.e. K maximises ETTR; when the host's replay and persist fit
    between checkpoints the two criteria agree.

    The smallest minimiser is returned because extra steps cost gradient traffic, host
    replay work and a longer window without lowering the stall; ``rel_tol`` (relative to
    the full-copy time) only absorbs floating-point noise. Returns 1 when one step hides
    the whole copy. When the stall cannot reach zero (budget at or below the gradient
    bytes), the growing gradient stream eventually makes the stall rise with K, so the
    minimiser lies inside the range rather than at ``max_k``.
    """
    max_k = check_int("max_k", max_k)
    rel_tol = check_number("rel_tol", rel_tol, nonnegative=True)
    if interval_steps is not None:
        interval_steps = check_int("interval_steps", interval_steps)
        max_k = min(max_k, interval_steps)
    if profile.state_bytes <= profile.transfer_budget_bytes:
        return 1

    def cost(k: int) -> float:
        if interval_steps is None:
            return predict_stall_s(profile, "overlap", k)
        return estimate(profile, "overlap", k, interval_steps).overhead_s

    costs = [cost(k) for k in range(1, max_k + 1)]
    best = min(costs)
    tol = rel_tol * profile.full_copy_s
    return next(k for k, c in enumerate(costs, start=1) if c <= best + tol)
