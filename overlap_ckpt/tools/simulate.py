"""Planning before buying hardware: predicted stall and ETTR per strategy, for a model size.

``overlap-ckpt simulate`` prints :func:`format_simulation_table` of :func:`simulate`. The
numbers come from the runtime model in :mod:`overlap_ckpt.costmodel` fed with assumed link
speeds (:data:`HARDWARE_PRESETS`); replace them with measured ones where you have them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from ..costmodel import GB, TrainingProfile, check_int, check_number, choose_k, estimate

@dataclasses.dataclass(frozen=True)
class HardwarePreset:
    """Assumed link speeds for planning; replace them with measured numbers.

    ``d2h_bytes_per_s`` is per accelerator (each has its own PCIe link);
    ``persist_bytes_per_s`` is per node and shared by ``accelerators_per_node``.
    """

    d2h_bytes_per_s: float
    persist_bytes_per_s: float
    accelerators_per_node: int
    note: str


HARDWARE_PRESETS: dict[str, HardwarePreset] = {
    "h100-pcie5": HardwarePreset(
        50 * GB, 5 * GB, 8,
        "H100, PCIe Gen5 x16 (64 GB/s raw) at ~50 GB/s effective pinned D2H; one NVMe "
        "volume at ~5 GB/s per node. Assumptions: override with measured values."),
    "a100-pcie4": HardwarePreset(
        25 * GB, 5 * GB, 8,
        "A100, PCIe Gen4 x16 (32 GB/s raw) at ~25 GB/s effective pinned D2H; one NVMe "
        "volume at ~5 GB/s per node. Assumptions: override with measured values."),
}


@dataclasses.dataclass(frozen=True)
class SimulationRow:
    """One strategy's prediction for one model/cluster size.

    ``k``, ``stall_s``, ``queue_wait_s`` and ``ettr`` are aligned with ``intervals``:
    auto-K may pick a different K for each checkpoint interval (K <= interval, and a
    short interval leaves less time for background work).
    """

    model_params: float
    n_accelerators: int
    state_bytes: float
    grad_bytes: float
    strategy: str
    label: str
    intervals: tuple[int, ...]
    k: tuple[int, ...]
    stall_s: tuple[float, ...]
    queue_wait_s: tuple[float, ...]
    ettr: tuple[float, ...]

    def ettr_at(self, interval_steps: int) -> float:
        return self.ettr[self.intervals.index(interval_steps)]


def simulate(model_params: float, n_accelerators: int, *, step_time_s: float,
             hardware: str = "h100-pcie5", d2h_gbps: float | None = None,
             persist_gbps: float | None = None, accelerators_per_node: int | None = None,
             overlappable_fraction: float = 0.9, state_bytes_per_param: float = 16.0,
             grad_bytes_per_param: float = 2.0, replay_gbps: float | None = None,
             intervals: Sequence[int] = (10, 50), max_k: int = 16) -> list[SimulationRow]:
    """Predict stall and ETTR of sync, async, K=1 overlap and auto-K for a model size.

    State and gradient are sharded FSDP/ZeRO-style over ``n_accelerators``, so each
    accelerator copies ``model_params * bytes_per_param / n``. Defaults: 16 B/param of
    state (bf16 params + fp32 master + fp32 Adam m, v; use 12-14 for other layouts) and
    2 B/param of bf16 gradient. Link speeds come from ``HARDWARE_PRESETS[hardware]``
    unless given explicitly in GB/s (1e9 B/s); the node's persist bandwidth is split
    between the ``min(n, accelerators_per_node)`` accelerators writing on it.
    ``replay_gbps`` is the host replay throughput per accelerator (None: not modelled).
    """
    if hardware not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware preset {hardware!r}; known: "
                         f"{sorted(HARDWARE_PRESETS)} (or pass d2h_gbps/persist_gbps)")
    preset = HARDWARE_PRESETS[hardware]
    model_params = check_number("model_params", model_params, positive=True)
    n = check_int("n_accelerators", n_accelerators)
    per_node = check_int("accelerators_per_node",
                          preset.accelerators_per_node if accelerators_per_node is None
                          else accelerators_per_node)
    d2h = (preset.d2h_bytes_per_s if d2h_gbps is None
           else check_number("d2h_gbps", d2h_gbps, positive=True) * GB)
    persist_node = (preset.persist_bytes_per_s if persist_gbps is None
                    else check_number("persist_gbps", persist_gbps, positive=True) * GB)
    replay = (None if replay_gbps is None
              else check_number("replay_gbps", replay_gbps, positive=True) * GB)
    intervals = tuple(check_int("interval", i) for i in intervals)
    if not intervals:
        raise ValueError("intervals must name at least one checkpoint interval")
    state = model_params * check_number("state_bytes_per_param", state_bytes_per_param,
                                         positive=True) / n
    grad = model_params * check_number("grad_bytes_per_param", grad_bytes_per_param,
                                        nonnegative=True) / n
    profile = TrainingProfile(
        step_time_s=step_time_s, d2h_bytes_per_s=d2h, state_bytes=state, grad_bytes=grad,
        persist_bytes_per_s=persist_node / min(n, per_node),
        overlappable_fraction=overlappable_fraction, replay_bytes_per_s=replay)

    def row(strategy: str, label: str, ks: Iterable[int]) -> SimulationRow:
        ests = [estimate(profile, strategy, k, i) for k, i in zip(ks, intervals)]
        return SimulationRow(
            model_params, n, state, grad, strategy, label, intervals,
            tuple(e.k for e in ests), tuple(e.stall_s for e in ests),
            tuple(e.queue_wait_s for e in ests), tuple(e.ettr for e in ests))

    ones = [1] * len(intervals)
    return [
        row("sync", "sync save", ones),
        row("async", "async snapshot", ones),
        row("overlap", "overlap K=1", ones),
        row("overlap", "overlap auto-K",
            [choose_k(profile, max_k=max_k, interval_steps=i) for i in intervals]),
    ]


def _fmt_params(p: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if p >= scale:
            return f"{p / scale:g}{suffix}"
    return f"{p:g}"


def _fmt_per_interval(values: Sequence[Any], fmt: str) -> str:
    """One value when all intervals agree, else ``a / b`` in interval order."""
    texts = [format(v, fmt) for v in values]
    return texts[0] if len(set(texts)) == 1 else " / ".join(texts)


def format_simulation_table(rows: Sequence[SimulationRow]) -> str:
    """Markdown table of :func:`simulate` rows (rows may come from several calls)."""
    if not rows:
        return ""
    intervals = rows[0].intervals
    if any(r.intervals != intervals for r in rows):
        raise ValueError("all rows must share the same checkpoint intervals")
    iv = " / ".join(str(i) for i in intervals)
    header = (["model", "accel.", "state/accel. (GB)", "strategy", f"K (N={iv})",
               f"stall/ckpt s (N={iv})", f"queue wait s (N={iv})"]
              + [f"ETTR @{i}" for i in intervals])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * 4 + ["--:"] * (len(header) - 4)) + "|"]
    for r in rows:
        cells = [_fmt_params(r.model_params), str(r.n_accelerators),
                 f"{r.state_bytes / GB:.2f}", r.label,
                 "-" if r.strategy != "overlap" else _fmt_per_interval(r.k, "d"),
                 _fmt_per_interval(r.stall_s, ".3f"),
                 _fmt_per_interval(r.queue_wait_s, ".3f")] + [f"{e:.4f}" for e in r.ettr]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
