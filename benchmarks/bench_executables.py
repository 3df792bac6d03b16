"""What one compiled step costs the host: its code, and what XLA:CPU holds besides it.

    python -m benchmarks.bench_executables --model 20m --k 3 --out benchmarks/results/cpu_20m_executables

Why: ``bench_host_memory`` finds that a window of K=3 on the 20M LM holds 0.60x of the
state in its three compiled step variants, the one part of its host memory that misses
issue 20's 1.25x bound. Whether that is the programs' code (which would grow with K on
every backend and call for fewer programs) or XLA:CPU's overhead per loaded executable
(which accelerators do not share) decides what to do about it. For the benchmark LM's plain
step and each window phase of K (the programs ``overlap-ckpt aot`` compiles), this measures:

* **serialized**: the size of the compiled executable as ``jax.experimental.serialize_executable``
  writes it: its code and what is needed to load it, for this CPU and for every compile-only
  accelerator target whose plugin this Python has (``h100`` with the ``aot-gpu`` wheels on
  ``PYTHONPATH``, see docs/aot.md);
* **lowering**: RSS added by lowering the program (what JAX's caches keep of the trace and
  the StableHLO module: the window step's dispatch needs them);
* **compiled here / loaded**: RSS added by compiling the lowered program in the process, and
  by loading its serialized form instead, each in a fresh process that has compiled and run
  a small program first (XLA:CPU's one-time set-up), after ``malloc_trim``.

Each figure is one fresh process; RSS is read from /proc (VmRSS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.harness import run_fresh, settled_rss
from benchmarks.reporting import publish

MIB = 2**20


def _programs(target_name: str, model: str, k: int):
    """(name, lowered, state bytes) of the plain step and each window phase of ``k``."""
    from overlap_ckpt.aot import get_target
    from overlap_ckpt.tools.aot.lm_step import lm_setup, lower_with, plan_window
    from overlap_ckpt.core.ticket import WindowTicket

    target = get_target(target_name, host_gbps=1.0)  # the link speed is not used here
    setup = lm_setup(target, model, batch_per_device=2)
    lower = lower_with(setup)
    plan = plan_window(setup, k)
    yield "plain step", lambda: lower(None), plan.state_bytes
    for phase in range(k):
        yield f"K={k} phase {phase}", lambda phase=phase: lower(WindowTicket(plan, phase)), plan.state_bytes


def serialized_sizes(target_name: str, model: str, k: int, directory: str | None) -> dict:
    """Serialized bytes of every program on ``target_name`` (kept in ``directory`` if given)."""
    from jax.experimental import serialize_executable

    sizes = {}
    for i, (name, lowered, state_bytes) in enumerate(_programs(target_name, model, k)):
        payload, _, _ = serialize_executable.serialize(lowered().compile())
        sizes[name] = len(payload)
        if directory:
            with open(os.path.join(directory, f"{i}.bin"), "wb") as f:
                f.write(payload)
    return {"target": target_name, "state_bytes": state_bytes, "serialized": sizes}


def resident(model: str, k: int, index: int, mode: str, directory: str) -> dict:
    """RSS added by lowering program ``index`` on this CPU, then by compiling it (``mode``
    "compile") or by loading its serialized form from ``directory`` ("load")."""
    import jax
    from jax.experimental import serialize_executable

    # XLA:CPU sets up its compiler and runtime at the first compile of a process: paid here,
    # by a program of its own, so that the figures below are the program's alone.
    jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(8)))
    name, lower, _ = list(_programs("cpu", model, k))[index]
    before = settled_rss()
    lowered = lower()
    after_lowering = settled_rss()
    if mode == "compile":
        executable = lowered.compile()
    else:
        with open(os.path.join(directory, f"{index}.bin"), "rb") as f:
            executable = serialize_executable.deserialize_and_load(f.read(), lowered.in_tree, lowered.out_tree)
    after = settled_rss()
    del executable
    return {"program": name, "mode": mode, "lowering_bytes": after_lowering - before,
            "executable_bytes": after - after_lowering}


def _run_worker(*args: str, pythonpath: str | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return run_fresh("benchmarks.bench_executables", ["--worker", *args], env=env)


def markdown(report: dict) -> str:
    cpu = report["sizes"]["cpu"]
    state = cpu["state_bytes"]
    targets = [t for t in report["sizes"] if t != "cpu"]
    lines = [f"# Host memory of one compiled program: {report['model']} LM, K={report['k']}", "",
             f"State (params + Adam) {state / MIB:.1f} MiB. MiB per program; one fresh process per figure.", "",
             "| program | serialized, this CPU | " + "".join(f"serialized, {t} | " for t in targets)
             + "lowering (RSS) | compiled here (RSS) | loaded from serialized (RSS) |",
             "|---|--:|" + "--:|" * len(targets) + "--:|--:|--:|"]
    for name, size in cpu["serialized"].items():
        compiled, loaded = report["resident"][name]["compile"], report["resident"][name]["load"]
        lines.append(f"| {name} | {size / MIB:.1f} | "
                     + "".join(f"{report['sizes'][t]['serialized'][name] / MIB:.1f} | " for t in targets)
                     + f"{compiled['lowering_bytes'] / MIB:.1f} | {compiled['executable_bytes'] / MIB:.1f} | "
                     f"{loaded['executable_bytes'] / MIB:.1f} |")
    if report["missing_targets"]:
        lines += ["", "Not compiled (plugin not importable): " + ", ".join(report["missing_targets"])]
    lines += ["", "Columns: see the module docstring of `benchmarks/bench_executables.py`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="20m", choices=("tiny", "small", "20m", "100m"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--targets", nargs="*", default=["h100"],
                    help="compile-only targets to size besides this CPU (default h100)")
    ap.add_argument("--gpu-plugin-path", default=None,
                    help="where the aot-gpu wheels are installed aside (default: CI's location, docs/aot.md)")
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    ap.add_argument("--worker", nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        kind, *rest = args.worker
        if kind == "sizes":
            target, directory = rest[0], rest[1] if len(rest) > 1 else None
            out = serialized_sizes(target, args.model, args.k, directory)
        else:
            out = resident(args.model, args.k, int(rest[0]), kind, rest[1])
        print(json.dumps(out))
        return {}
    import jax

    plugin_path = args.gpu_plugin_path or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "overlap_ckpt", f"aot-gpu-{jax.__version__}")
    common = ["--model", args.model, "--k", str(args.k)]
    report = {"benchmark": "bench_executables", "model": args.model, "k": args.k, "sizes": {},
              "resident": {}, "missing_targets": []}
    with tempfile.TemporaryDirectory(prefix="bench_executables_") as directory:
        report["sizes"]["cpu"] = _run_worker("sizes", "cpu", directory, *common)
        for target in args.targets:
            try:
                report["sizes"][target] = _run_worker("sizes", target, *common, pythonpath=plugin_path)
            except RuntimeError as e:
                print(f"{target}: not compiled ({str(e).splitlines()[-1]})", file=sys.stderr)
                report["missing_targets"].append(target)
        for index, name in enumerate(report["sizes"]["cpu"]["serialized"]):
            report["resident"][name] = {mode: _run_worker(mode, str(index), directory, *common)
                                        for mode in ("compile", "load")}
    report["loadavg_at_end"] = list(os.getloadavg())
    publish(report, markdown(report), args.out)
    return report


if __name__ == "__main__":
    main()
