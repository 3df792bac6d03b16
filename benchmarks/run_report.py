"""``benchmarks.run``'s report as Markdown: the header, one table row per configuration run,
the targets and the definitions (the reports of this benchmark kept in benchmarks/results).

Apart from the analysis so that the report's layout can change without touching a figure.
"""

from __future__ import annotations

from benchmarks.run_configs import AFTER_STEPS, LABELS


def fmt(x: float | None, spec: str = ".3f", none: str = "n/a") -> str:
    """``x`` formatted with ``spec`` (``none`` for None)."""
    return none if x is None else format(x, spec)


def ms(x: float | None) -> str:
    """Seconds as milliseconds with one decimal ("n/a" for None)."""
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "missed")


def markdown(report: dict) -> str:
    base = report["baseline"]
    m = report["machine"]
    lines = [f"# overlap_ckpt vs Orbax: {report['model']} on {report['backend']}", "",
             f"- model `{report['model']}`: {report['num_params'] / 1e6:.2f}M params, state (params + adamw) "
             f"{report['state_bytes'] / 2**20:.1f} MiB; batch {report['batch_size']}; "
             f"{report['steps']} measured steps per run after warm-up",
             f"- machine: {m['platform']}, {m['cpus']} CPUs, device `{report['device']}`",
             f"- no-checkpoint step: median {ms(base['median_step_s'])} ms, mean {ms(base['mean_step_s'])} ms; "
             f"D2H {(fmt(base.get('d2h_bytes_per_s') and base['d2h_bytes_per_s'] / 1e9, '.2f'))} GB/s; "
             f"raw fsync'd sequential write {report['raw_write']['median_gibps']:.3f} GiB/s",
             f"- loop: {'block_until_ready after every step' if report.get('sync_every', 1) == 1 else 'no per-step sync; the loss is fetched every %d steps' % report['sync_every']}; "
             f"host budget policy `{report.get('on_host_budget', 'wait')}`",
             f"- cost model: overlappable fraction {report['overlappable_fraction']}, persist bandwidth = "
             "raw write, replay bandwidth = measured K=3 replay", ""]
    hdr = ["config", "N", "K", "median step ms (x none)", "non-window step ms (x none)",
           "compile s (x none)", "ckpts committed", "stall/ckpt ms: window steps",
           f"steps after it: +1..+{AFTER_STEPS}", "dispatch ms: other steps / +1", "over the span", "predicted",
           "x Orbax async", "ETTR: measured", "predicted", "x Orbax async", "final wait ms",
           "persist GiB/s (x raw alone)", "restore ms (Orbax/ours)", "peak RSS MiB (extra / state)", "replay GB/s"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] + ["--:"] * (len(hdr) - 1)) + "|"]
    raw = report["raw_write"]["median_gibps"]
    rows = [report["baseline"]] + report["results"]
    for r in rows:
        n = r.get("interval")
        oa = next((x for x in report["results"] if x["config"] == "orbax_async" and x["interval"] == n), None)
        ob = next((x for x in report["results"] if x["config"].startswith("orbax") and x["interval"] == n
                   and x.get("restore_s")), None)
        pred = r.get("prediction") or {}
        stall = r.get("stall_per_ckpt_s")
        vs_stall = (f"{stall / oa['stall_per_ckpt_s']:.2f}x" if stall is not None and oa
                    and oa.get("stall_per_ckpt_s") and oa["stall_per_ckpt_s"] > 0 else "-")
        vs_ettr = f"{r['ettr'] / oa['ettr']:.3f}x" if oa and r["config"] != "none" else "-"
        persist = (f"{r['persist_gibps']:.3f} ({r['persist_gibps'] / raw:.2f}x)" if r.get("persist_gibps")
                   else (f"{r['sync_save_gibps']:.3f} (save+D2H)" if r.get("sync_save_gibps") else "-"))
        if r.get("restore_s") is None:
            restore = "-"
        elif r["config"].startswith("overlap") and ob:
            restore = f"{r['restore_s'] * 1e3:.1f} ({ob['restore_s'] / r['restore_s']:.2f}x)"
        else:
            restore = f"{r['restore_s'] * 1e3:.1f}"
        rss = f"{r['rss_peak_bytes'] / 2**20:.0f}" if r["config"] != "raw_beside" else "- (its source arrays)"
        if r.get("rss_extra_vs_state") is not None and r["config"] not in ("none", "raw_beside"):
            rss += f" ({r['rss_extra_vs_state']:+.2f}x)"
        plain = r.get("median_plain_step_s")
        compile_s = r.get("compile_s")
        committed = "-" if r["config"] == "none" else str(r.get("committed"))
        if r.get("host_budget") and (r["host_budget"]["delayed"] or r["host_budget"]["skipped"]):
            committed += f" ({r['host_budget']['delayed']} delayed, {len(r['host_budget']['skipped'])} skipped)"
        cells = [LABELS[r["config"]], str(n or "-"), str(r.get("k", "-")),
                 f"{ms(r['median_step_s'])} ({r['median_step_s'] / base['median_step_s']:.2f}x)",
                 "-" if plain is None else f"{ms(plain)} ({plain / base['median_step_s']:.3f}x)",
                 "-" if compile_s is None else (f"{compile_s:.1f} ({compile_s / base['compile_s']:.2f}x)"
                                                if base.get("compile_s") else f"{compile_s:.1f}"),
                 committed, ms(stall), " / ".join(ms(x) for x in r.get("extra_after_ckpt_s") or [None]),
                 f"{ms(r.get('dispatch_plain_s'))} / {ms((r.get('dispatch_after_ckpt_s') or [None])[0])}",
                 ms(r.get("stall_span_per_ckpt_s")), ms(pred.get("stall_s")), vs_stall,
                 f"{r['ettr']:.3f}", fmt(pred.get("ettr")), vs_ettr,
                 ms(r.get("final_wait_s")) if r["config"] != "none" else "-", persist, restore, rss,
                 fmt(r.get("replay_gbps"), ".2f", "-")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets", ""]
    for tgt in report["targets"]:
        lines.append(f"- {tgt['name']}: {tgt['text']} -- **{_mark(tgt['met'])}**")
    lines += ["", "Definitions: ckpts committed = checkpoints written from the measured span (overlap: "
              "persisted windows, with those the host budget delayed or skipped; Orbax: saves). stall/ckpt "
              "over the span = (sum of measured step times - steps x no-checkpoint mean step) / ckpts "
              "committed: the only stall that means something when the loop does not sync every step. "
              "stall/ckpt on window steps = extra time over the no-checkpoint median step, summed over the "
              "steps attributed to a checkpoint (Orbax: the step that calls save; overlap: the K window "
              "steps), mean over the measured checkpoints; the final `wait_until_finished` is reported "
              "separately. Steps after it: the median extra time over the no-checkpoint median of the 1st, "
              "2nd, ... step after a checkpoint's last step (none of them in the next window). Dispatch: "
              "the training thread's time to issue a step (the jitted call, which frees the donated state, "
              "and the manager's step or save), median over the steps outside checkpoints and over the "
              "first step after each; on an accelerator, the time the device waits when it exceeds the "
              "queued work. "
              "ETTR = mean no-checkpoint step time / mean step time. Peak RSS extra = peak RSS "
              "minus the no-checkpoint run's peak RSS, relative to the state bytes. Raw write beside training: "
              "no checkpoint, the state's bytes written to one file and fsync'd by a background thread at every "
              "N-th step (one write at a time); its persist column is the disk speed beside training, the "
              "persist target's reference. Restore = median of "
              f"{report['restore_repeats']} restores of the last step into the abstract state, warm page cache.",
              ""]
    if report.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    return "\n".join(lines)
