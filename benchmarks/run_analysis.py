"""The figures of ``benchmarks.run``'s report, computed from what its workers measured: step
times against the no-checkpoint run, stalls per checkpoint, ETTR, persist and restore speed,
host memory, the cost model's prediction and the targets met or missed.

Definitions are in benchmarks/README.md ("Definitions"); they live apart from the worker so
that an earlier run's JSON (its ``raw_runs``) can be analysed again without training.
"""

from __future__ import annotations

import statistics

from benchmarks.run_configs import AFTER_STEPS, GIB, LABELS, TARGETS
from benchmarks.run_report import fmt, ms


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _checkpoint_step(row: dict) -> bool:
    """A measured step that takes part in a checkpoint: a window phase, or the step that
    called save (Orbax) or started a raw write."""
    return row["phase"] is not None or row["save"]


def analyse(run: dict, base_median: float, base_mean: float) -> dict:
    """Step-time statistics, stalls per checkpoint and ETTR of one configuration run."""
    dts = [r["end"] - r["start"] for r in run["steps"]]
    res = {"median_step_s": _median(dts), "mean_step_s": statistics.mean(dts), "measured_steps": len(dts)}
    plain = [dt for r, dt in zip(run["steps"], dts) if not _checkpoint_step(r)]
    res["median_plain_step_s"] = _median(plain)
    # RSS after each measured step, beside the process's peak (ru_maxrss): a peak well above
    # every step's RSS was reached outside the loop's steady state (a compile, the warm-up).
    res["rss_by_step_bytes"] = [r["rss"] for r in run["steps"]]
    res["rss_before_train_bytes"] = run.get("rss_before_train_bytes")
    res["compile_s"] = run.get("compile_s")
    res["ettr"] = base_mean / res["mean_step_s"]
    groups: dict[int, list[float]] = {}
    cfg = run["config"]
    if cfg.startswith("overlap"):
        k = run["k"]
        for r, dt in zip(run["steps"], dts):
            if r["phase"] is not None:
                groups.setdefault(r["t"] - r["phase"] + k - 1, []).append(dt - base_median)
        # only complete windows (all K steps measured)
        groups = {v: g for v, g in groups.items() if len(g) == k}
    elif cfg.startswith("orbax") or cfg == "raw_beside":
        n = run["interval"]
        for r, dt in zip(run["steps"], dts):
            if (r["t"] + 1) % n == 0:
                groups[r["t"] + 1] = [dt - base_median]
    stalls = [sum(g) for g in groups.values()]
    res["extra_after_ckpt_s"] = _after_checkpoints(run["steps"], dts, base_median)
    dispatch = [r["dispatched"] - r["start"] for r in run["steps"]]
    res["dispatch_plain_s"] = _median([d for r, d in zip(run["steps"], dispatch) if not _checkpoint_step(r)])
    res["dispatch_after_ckpt_s"] = _after_checkpoints(run["steps"], dispatch, 0.0)
    # Committed in the measured span (overlap: persisted windows; Orbax: saves issued).
    # raw_beside: writes done (a write still running at the next checkpoint step is not started).
    res["committed"] = (len(run["persist"]) if cfg.startswith("overlap") or cfg == "raw_beside"
                        else sum(r["save"] for r in run["steps"]))
    res["stall_span_per_ckpt_s"] = ((sum(dts) - len(dts) * base_mean) / res["committed"]
                                    if res["committed"] else None)
    res["checkpoints_measured"] = len(stalls)
    res["stall_per_ckpt_s"] = statistics.mean(stalls) if stalls else None
    res["stall_per_ckpt_median_s"] = _median(stalls)
    if run.get("persist"):
        rec = run["persist"]
        res["persist_gibps"] = sum(p["nbytes"] for p in rec) / GIB / sum(p["persist_s"] for p in rec)
        res["persist_s_median"] = _median([p["persist_s"] for p in rec])
        res["persist_write_gibps"] = [p["nbytes"] / GIB / p["persist_s"] for p in rec]
    if cfg == "orbax_sync" and res["stall_per_ckpt_s"]:
        res["sync_save_gibps"] = run["state_bytes"] / GIB / res["stall_per_ckpt_s"]
    if run.get("replayed_bytes"):
        res["replay_gbps"] = run["replayed_bytes"] / 1e9 / run["replay_seconds"]
    if run.get("restore_s"):
        res["restore_s"] = _median(run["restore_s"])
    return res


def _after_checkpoints(steps: list[dict], values: list[float], base: float) -> list[float | None]:
    """Median of ``value - base`` over the 1st, 2nd, ... step after each checkpoint's last step
    (a window's last phase, the step that called save, a raw write): the extra step time over
    the no-checkpoint median, or the training thread's time to issue the step.

    Why: on an H200 and on this CPU most of a checkpoint's cost was in the step after the
    window, not in the window (the host worker's hand-off and the persist starting beside the
    next step); the span stall shows the total, this shows where it lands.
    """
    ends = [i for i, r in enumerate(steps)
            if _checkpoint_step(r) and (i + 1 == len(steps) or not _checkpoint_step(steps[i + 1]))]
    out = []
    for off in range(1, AFTER_STEPS + 1):
        extra = [values[i + off] - base for i in ends
                 if i + off < len(steps) and not any(_checkpoint_step(steps[j]) for j in range(i + 1, i + off + 1))]
        out.append(_median(extra))
    return out


def predict(run: dict, base: dict, persist_bps: float, f: float, replay_bps: float | None) -> dict | None:
    """The cost model's stall and ETTR for ``run``'s configuration, from the measured
    no-checkpoint step, device-to-host and persist bandwidths (None for the references)."""
    from overlap_ckpt import costmodel

    cfg = run["config"]
    if cfg in ("none", "raw_beside") or not base.get("d2h_bytes_per_s"):
        return None
    profile = costmodel.TrainingProfile(
        step_time_s=base["median_step_s"], d2h_bytes_per_s=base["d2h_bytes_per_s"],
        state_bytes=run["state_bytes"], grad_bytes=run["param_bytes"], persist_bytes_per_s=persist_bps,
        overlappable_fraction=f, replay_bytes_per_s=replay_bps)
    strategy = {"orbax_sync": "sync", "orbax_async": "async"}.get(cfg, "overlap")
    k = run.get("k", 1)
    est = costmodel.estimate(profile, strategy, k, run["interval"])
    return {"strategy": strategy, "k": est.k, "stall_s": est.stall_s, "queue_wait_s": est.queue_wait_s,
            "background_s": est.background_s, "ettr": est.ettr,
            "inputs": {"step_time_s": profile.step_time_s, "d2h_bytes_per_s": profile.d2h_bytes_per_s,
                       "state_bytes": profile.state_bytes, "grad_bytes": profile.grad_bytes,
                       "persist_bytes_per_s": persist_bps, "overlappable_fraction": f,
                       "replay_bytes_per_s": replay_bps}}


def compare(base_run: dict, runs: list[dict], raw_gibps: float, f: float) -> tuple[dict, list[dict], list[str]]:
    """The no-checkpoint baseline, one result per configuration run (each against that
    baseline, with the cost model's prediction) and the warnings the runs raise."""
    base = analyse(base_run, 1.0, 1.0)
    base.update({k: base_run[k] for k in ("config", "rss_peak_bytes", "d2h_bytes_per_s", "state_bytes",
                                            "param_bytes")})
    base["ettr"] = 1.0
    base["rss_extra_vs_state"] = 0.0
    warnings = []
    results = []
    for run in runs:
        res = analyse(run, base["median_step_s"], base["mean_step_s"])
        res.update({"config": run["config"], "interval": run["interval"], "final_wait_s": run["final_wait_s"],
                    "host_budget": run.get("host_budget"),
                    "rss_peak_bytes": run["rss_peak_bytes"], "state_bytes": run["state_bytes"]})
        if "k" in run:
            res["k"] = run["k"]
            res["windows_completed"] = run["windows_completed"]
            res["windows_aborted"] = run.get("windows_aborted", 0)
            if run.get("windows_aborted"):
                warnings.append(f"{run['config']} N={run['interval']}: {run['windows_aborted']} windows aborted")
        res["rss_extra_vs_state"] = (run["rss_peak_bytes"] - base["rss_peak_bytes"]) / run["state_bytes"]
        res["rss_peak_vs_state"] = run["rss_peak_bytes"] / run["state_bytes"]
        if run.get("restore_step_ok") is False:
            warnings.append(f"{run['config']} N={run['interval']}: restored step counter mismatch")
        if res["checkpoints_measured"] == 0:
            warnings.append(f"{run['config']} N={run['interval']}: no checkpoint in the measured steps")
        results.append(res)
    for run, res in zip(runs, results):
        k3 = next((r for r in results if r["config"] == "overlap_k3" and r["interval"] == run["interval"]), None)
        replay = k3["replay_gbps"] * 1e9 if k3 and k3.get("replay_gbps") else None
        res["prediction"] = predict(run, base, raw_gibps * GIB, f, replay)
    return base, results, warnings


def targets(report: dict) -> list[dict]:
    """Each target of the report (``run_configs.TARGETS``): its value, met or not, and a line
    of text saying which run decided it."""
    rows = report["results"]
    base = report["baseline"]

    def get(cfg, n):
        return next((r for r in rows if r["config"] == cfg and r["interval"] == n), None)

    def target(name, value, met, text):
        return {"name": name, "value": value, "met": met, "text": text}

    out = []
    plain = [(r["config"], r["interval"], r["median_plain_step_s"] / base["median_step_s"]) for r in rows
             if r["config"].startswith("overlap") and r.get("median_plain_step_s")]
    worst = max(plain, key=lambda p: p[2]) if plain else None
    out.append(target(f"median non-window step within {TARGETS['plain_step_vs_none'] - 1:.0%} of no checkpointing",
                      worst and worst[2], None if worst is None else worst[2] <= TARGETS["plain_step_vs_none"],
                      "worst overlap run: " + ("n/a" if worst is None else
                                               f"{LABELS[worst[0]]} N={worst[1]} at {worst[2]:.3f}x")))
    for n in report["intervals"]:
        orbax = get("orbax_async", n)
        ours = [(c, get(c, n)) for c in ("overlap_auto", "overlap_k1", "overlap_k3") if get(c, n)]
        if orbax is None or not ours:
            continue
        best = max(ours, key=lambda c: c[1]["ettr"])
        auto = get("overlap_auto", n) or best[1]
        out.append(target(f"ETTR >= Orbax async's at N={n}", auto["ettr"] / orbax["ettr"],
                          auto["ettr"] >= orbax["ettr"],
                          f"overlap auto-K (K={auto.get('k')}) {auto['ettr']:.3f} vs Orbax async "
                          f"{orbax['ettr']:.3f}; best overlap config {LABELS[best[0]]} {best[1]['ettr']:.3f}"))
    n10 = 10 if 10 in report["intervals"] else min(report["intervals"])
    auto = get("overlap_auto", n10)
    e = auto["ettr"] if auto else None
    out.append(target(f"goal: overlap ETTR >= {TARGETS['ettr']} at N={n10}", e,
                      None if e is None else e >= TARGETS["ettr"], f"overlap auto-K {fmt(e)}"))
    extra = [r["rss_extra_vs_state"] for r in rows if r["config"].startswith("overlap")
             and r.get("rss_extra_vs_state") is not None]
    worst_rss = max(extra) if extra else None
    out.append(target(f"peak RSS above the no-checkpoint run <= {TARGETS['rss_vs_state']}x state", worst_rss,
                      None if worst_rss is None else worst_rss <= TARGETS["rss_vs_state"],
                      f"worst overlap run {fmt(worst_rss, '.2f')}x state"))
    # Medians over every write, pooled across runs: a run at N=50 writes twice, and one slow
    # write on this VM's disk would otherwise carry half its run's figure.
    ours = [g for r in rows if r["config"].startswith("overlap") for g in r.get("persist_write_gibps", [])]
    raws = [g for r in rows if r["config"] == "raw_beside" for g in r.get("persist_write_gibps", [])]
    persist, beside, alone = _median(ours), _median(raws), report["raw_write"]["median_gibps"]
    raw = beside or alone  # without a raw_beside run, only the write measured alone is there
    p = persist / raw if persist else None
    out.append(target(f"persist beside training >= {TARGETS['persist_vs_raw']:.0%} of a raw fsync'd write "
                      + ("beside the same training" if beside else "measured alone"), p,
                      None if p is None else p >= TARGETS["persist_vs_raw"],
                      f"{fmt(p, '.2f')}x (medians over every write: ours {fmt(persist, '.3f')} GiB/s, "
                      f"{len(ours)} writes, vs "
                      + (f"raw beside training {beside:.3f} GiB/s, {len(raws)} writes; raw alone "
                         f"{alone:.3f} GiB/s: {fmt(persist and persist / alone, '.2f')}x)" if beside
                         else f"raw alone {alone:.3f} GiB/s)")))
    compile_ratio = [(r["config"], r["interval"], r["compile_s"] / base["compile_s"]) for r in rows
                     if r["config"].startswith("overlap") and r.get("compile_s") and base.get("compile_s")]
    worst_c = max(compile_ratio, key=lambda c: c[2]) if compile_ratio else None
    out.append(target(f"training-thread compile time <= {TARGETS['compile_vs_plain']}x the plain loop's",
                      worst_c and worst_c[2], None if worst_c is None else worst_c[2] <= TARGETS["compile_vs_plain"],
                      "worst overlap run: " + ("n/a" if worst_c is None else
                                               f"{LABELS[worst_c[0]]} N={worst_c[1]} at {worst_c[2]:.2f}x "
                                               f"({base['compile_s']:.1f} s plain)")))
    ours = [r["restore_s"] for r in rows if r["config"].startswith("overlap") and r.get("restore_s")]
    theirs = [r["restore_s"] for r in rows if r["config"].startswith("orbax") and r.get("restore_s")]
    ratio = _median(theirs) / _median(ours) if ours and theirs else None
    out.append(target(f"restore >= {TARGETS['restore_vs_orbax']:.0f}x Orbax", ratio,
                      None if ratio is None else ratio >= TARGETS["restore_vs_orbax"],
                      f"{fmt(ratio, '.2f')}{'x' if ratio else ''} (ours {ms(_median(ours))} ms vs Orbax "
                      f"{ms(_median(theirs))} ms, median, warm cache)"))
    return out
