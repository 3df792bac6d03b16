"""Timeline of one overlapped checkpoint window, from the timestamps ``benchmarks.run`` records.

Rows (all times ``time.perf_counter()`` of the worker process, shown relative to the start of
the window's first step):

* ``train step``: every step around the window; window steps are coloured by phase j (their
  jitted program also copies state slice j + the gradient pieces to pinned host memory);
* ``capture (slice j + grads)``: the same spans, labelled, for the window steps only (the copy
  is inside the step's program, so it has no timestamps of its own);
* ``host receive + replay``: the engine's per-phase span (wait for the outbox, copy into the
  host buffers, replay the optimizer), from ``OverlapEngine.spans``;
* ``persist``: the storage write of that version, from ``CheckpointStore.history``.

    python -m benchmarks.timeline results.json out.png   # re-plot from a benchmarks.run JSON
"""

from __future__ import annotations

import sys


def _pick_window(run: dict) -> int | None:
    """Version of the last window fully inside the measured steps that has a persist record."""
    k = run["k"]
    phases: dict[int, set] = {}
    for r in run["steps"]:
        if r["phase"] is not None:
            phases.setdefault(r["t"] - r["phase"] + k - 1, set()).add(r["phase"])
    persisted = {p["step"] for p in run.get("persist", [])}
    complete = [v for v, ph in phases.items() if len(ph) == k and v in persisted]
    if not complete:
        complete = [v for v, ph in phases.items() if len(ph) == k]
    if not complete:
        return None
    return complete[-2] if len(complete) > 1 else complete[-1]


def plot_timeline(run: dict, path: str, base_median_s: float | None = None) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    version = _pick_window(run)
    if version is None:
        return None
    k = run["k"]
    window_steps = [r for r in run["steps"] if r["phase"] is not None and r["t"] - r["phase"] + k - 1 == version]
    first = min(r["t"] for r in window_steps)
    t0 = min(r["start"] for r in window_steps)
    persist = next((p for p in run.get("persist", []) if p["step"] == version), None)
    replay = [s for s in run.get("replay_spans", []) if s[0] - s[1] + k - 1 == version]
    end = max([r["end"] for r in window_steps] + [s[3] for s in replay]
              + ([persist["start"] + persist["persist_s"]] if persist and persist["start"] else []))
    shown = [r for r in run["steps"] if r["t"] >= first - 2 and r["start"] <= end + 1e-9]
    shown = [r for r in shown if r["t"] <= max(x["t"] for x in window_steps) + 2 or r["start"] <= end]

    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(11, 3.6))
    rows = ["persist", "host receive + replay", "capture (slice j + grads)", "train step"]
    y = {name: i for i, name in enumerate(rows)}
    h = 0.6
    ms = lambda x: (x - t0) * 1e3  # noqa: E731

    for r in shown:
        c = colors(1 + r["phase"]) if r["phase"] is not None and r["t"] - r["phase"] + k - 1 == version \
            else "0.75"
        ax.broken_barh([(ms(r["start"]), (r["end"] - r["start"]) * 1e3)], (y["train step"] - h / 2, h),
                       facecolors=c, edgecolors="black", linewidth=0.5)
        ax.text(ms((r["start"] + r["end"]) / 2), y["train step"], str(r["t"]), ha="center", va="center", fontsize=7)
    for r in window_steps:
        ax.broken_barh([(ms(r["start"]), (r["end"] - r["start"]) * 1e3)],
                       (y["capture (slice j + grads)"] - h / 2, h), facecolors=colors(1 + r["phase"]),
                       alpha=0.6, edgecolors="black", linewidth=0.5)
        ax.text(ms((r["start"] + r["end"]) / 2), y["capture (slice j + grads)"], f"j={r['phase']}",
                ha="center", va="center", fontsize=7)
    for step, phase, s, e in replay:
        ax.broken_barh([(ms(s), max((e - s) * 1e3, 0.05))], (y["host receive + replay"] - h / 2, h),
                       facecolors=colors(1 + phase), edgecolors="black", linewidth=0.5)
    if persist and persist["start"]:
        ax.broken_barh([(ms(persist["start"]), persist["persist_s"] * 1e3)], (y["persist"] - h / 2, h),
                       facecolors=colors(0), edgecolors="black", linewidth=0.5)
        ax.text(ms(persist["start"] + persist["persist_s"] / 2), y["persist"],
                f"{persist['nbytes'] / 2**20:.1f} MiB, {persist['persist_s'] * 1e3:.0f} ms",
                ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("ms since the window's first step")
    title = (f"{run['config']} (K={k}, N={run['interval']}): checkpoint of step {version}, "
             f"steps {first}..{first + k - 1}")
    if base_median_s:
        title += f"; no-checkpoint median step {base_median_s * 1e3:.1f} ms"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    import json

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        report = json.load(f)
    runs = report["raw_runs"]
    pick = next((r for name, r in runs.items() if name.startswith("overlap_k3")), None) or \
        next(r for name, r in runs.items() if name.startswith("overlap"))
    print(plot_timeline(pick, argv[1], report["baseline"]["median_step_s"]))


if __name__ == "__main__":
    main()
