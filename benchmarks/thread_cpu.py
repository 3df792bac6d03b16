"""CPU seconds of this process by thread group, read from ``/proc/self/task``.

Why: on the CPU backend the device is the host's own cores, so a checkpoint's cost is not
only what the training thread waits for but what every other thread takes from the step's
compute: XLA's intra-op threads (the step itself), overlap_ckpt's replay and persist
threads, Orbax's and tensorstore's writers. ``resource.getrusage`` gives the process's total;
this splits it, so a benchmark can say which thread a checkpoint's CPU seconds went to.

A thread is grouped by its Python name where it has one (``threading.Thread(name=...)``:
the library names its threads ``overlap-ckpt-<job>``), else by the kernel's name of it
(``comm``: ``tf_XLAEigen`` for XLA:CPU's compute pool, ``ts_pool_worker`` for tensorstore).
Threads that ended between two readings are counted up to the last reading that saw them.
Linux only (``/proc``); elsewhere :func:`read` returns an empty mapping.
"""

from __future__ import annotations

import os
import re
import threading

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

# Kernel thread names (a prefix of ``comm``, 15 characters at most) and the group each is counted in.
_COMM_GROUPS = (("tf_XLAEigen", "xla compute"), ("XLAEigen", "xla compute"), ("ts_", "tensorstore"),
                ("pjrt", "pjrt"), ("python", "other python"))


_NUMBERED = re.compile(r"^Thread-\d+ \((.*)\)$|_\d+$")


def group_of(python_name: str | None, comm: str) -> str:
    """The group a thread's CPU time is counted in."""
    if python_name == "MainThread":
        return "training"
    if python_name is not None:
        if python_name.startswith("overlap-ckpt-"):
            return python_name.removeprefix("overlap-ckpt-")
        # "Thread-7 (_save_fn)" -> "python: _save_fn"; a numbered suffix ("metadata_store_0") dropped
        unnumbered = _NUMBERED.sub(r"\1", python_name)
        return f"python: {unnumbered}"
    for prefix, group in _COMM_GROUPS:
        if comm.startswith(prefix):
            return group
    return "other native"


def read() -> dict[int, tuple[str, float]]:
    """Per thread id: (its group, CPU seconds so far, user + system)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        # Fields after the parenthesised name: state is field 3, utime 14 and stime 15.
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) * _TICK_S
        out[int(tid)] = (group_of(names.get(int(tid)), comm), seconds)
    return out


def by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`read` s, summed per group."""
    groups: dict[str, float] = {}
    for tid, (group, seconds) in after.items():
        spent = seconds - before.get(tid, (group, 0.0))[1]
        if spent > 0:
            groups[group] = groups.get(group, 0.0) + spent
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def with_ended(by_thread: dict[str, float], process_cpu_s: float) -> dict[str, float]:
    """``by_thread`` (from :func:`by_group`) plus ``"threads that ended"``: the process's CPU
    seconds over the same span (``resource.getrusage``) that no reading saw, those of
    threads that started and ended between the two readings (Orbax starts one per save)."""
    return {**by_thread, "threads that ended": process_cpu_s - sum(by_thread.values())}
