"""``overlap-ckpt``: demo, inspect and verify overlapped checkpoints from the command line.

    overlap-ckpt demo [--dir D] [--steps 120] [--interval 20] [--window 3] [--quiet]
    overlap-ckpt inspect DIR
    overlap-ckpt verify DIR [--step N]
    overlap-ckpt simulate --params 7e9 [--accelerators 8 64] [--step-time 1.0] [--intervals 10 50]

User errors (missing or unwritable directory, not a checkpoint directory) print one line on
stderr and exit 1; Ctrl-C exits 130 after naming the last committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from .models.config import LMConfig

DEMO_MARKER = ".overlap_ckpt_demo"
DEFAULT_DEMO_DIR = "./overlap_ckpt_demo"


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit 1."""


# -- helpers ---------------------------------------------------------------------------------
def _checkpoint_dir(path: str) -> str:
    if not os.path.exists(path):
        raise UserError(f"no such directory: {path}")
    if not os.path.isdir(path):
        raise UserError(f"not a directory: {path}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UserError(f"cannot read directory: {path}")
    return path


def _open_store(path: str):
    from ..storage import CheckpointStore, commit

    store = CheckpointStore(_checkpoint_dir(path), read_only=True)
    listing = commit.list_steps(store.location)
    if not listing.complete and not listing.incomplete:
        store.close()
        raise UserError(f"{path} is not a checkpoint directory (no step directories found)")
    return store, listing


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _last_committed(path: str) -> int | None:
    try:
        from ..storage import CheckpointStore

        if not os.path.isdir(path):
            return None
        store = CheckpointStore(path, read_only=True)
        try:
            return store.latest_step()
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - best effort on the way out
        return None


# -- inspect ---------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    from ..storage import layout, restore

    store, listing = _open_store(args.dir)
    try:
        print(f"checkpoint directory: {os.path.abspath(args.dir)}")
        rows = [(s, "complete", layout.step_dir(s)) for s in listing.complete]
        rows += [(s, "incomplete", layout.tmp_dir(s)) for s in listing.incomplete]
        rows.sort()
        print(f"{'step':>8}  {'status':<10}  {'size':>10}")
        for step, status, rel in rows:
            full = os.path.join(args.dir, rel)
            if not os.path.isdir(full):  # tmp dirs may carry a suffix after the standard one
                cands = [n for n in os.listdir(args.dir) if layout.parse_step_name(n) == (step, False)]
                full = os.path.join(args.dir, cands[0]) if cands else full
            print(f"{step:>8}  {status:<10}  {_mb(_du(full)):>10}")
        print(f"{len(listing.complete)} complete, {len(listing.incomplete)} incomplete")
        latest = store.latest_step()
        if latest is None:
            print("no complete step: nothing to summarize")
            return 0
        view = restore.open_step(store.location, latest, layout.step_dir(latest), store.item_name)
        leaves = view.array_leaves()
        total = 0
        if view.manifest is not None:
            total = sum(view.manifest[leaf.name].nbytes for leaf in leaves)
        else:
            stores = restore.open_arrays(view, [leaf.name for leaf in leaves], store.context)
            total = sum(restore.stored_nbytes(s) for s in stores.values())
        top = []
        for leaf in view.tree.leaves:
            if leaf.keys and leaf.keys[0] not in top:
                top.append(leaf.keys[0])
        print(f"latest step {latest}: {len(leaves)} leaves, {total} bytes ({_mb(total)}), "
              f"top-level keys: {', '.join(top)}")
        if view.custom_metadata:
            print(f"metadata: {json.dumps(view.custom_metadata, sort_keys=True)}")
        return 0
    finally:
        store.close()


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args) -> int:
    store, listing = _open_store(args.dir)
    try:
        if args.step is not None and args.step not in listing.complete:
            state = "incomplete" if args.step in listing.incomplete else "not found"
            print(f"step {args.step}: FAULT: step {state} in {args.dir}")
            return 1
        report = store.verify(args.step)
        for step, check in sorted(report.steps.items()):
            if check.ok:
                crc = "" if check.checksummed else " (no checksums)"
                print(f"step {step}: OK ({check.arrays} arrays, {check.chunks} chunks, "
                      f"{_mb(check.bytes)}){crc}")
            else:
                print(f"step {step}: FAULT")
                for problem in check.problems:
                    print(f"    {problem.splitlines()[0] if problem else problem}")
        if report.incomplete_steps and args.step is None:
            print(f"incomplete (uncommitted) steps, ignored: {report.incomplete_steps}")
        if not report.steps:
            print("no complete step to verify")
            return 1
        return 0 if report.ok else 1
    finally:
        store.close()


# -- demo ------------------------------------------------------------------------------------
class _Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stdout.isatty() and not quiet
        self._open = False

    def line(self, msg: str) -> None:
        if self._open:
            sys.stdout.write("\n")
            self._open = False
        print(msg, flush=True)

    def step(self, label: str, t: int, total: int) -> None:
        if self.tty:
            sys.stdout.write(f"\r  {label}: step {t + 1}/{total}   ")
            sys.stdout.flush()
            self._open = True

    def end(self) -> None:
        if self._open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._open = False


class _Worker:
    """One ``python -m overlap_ckpt.tools.demo train`` subprocess, its JSON events read line by line."""

    current: "_Worker | None" = None

    def __init__(self, argv: list[str], env: dict, handshake: bool = False):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "overlap_ckpt.tools.demo", "train", *argv], env=env,
            stdout=subprocess.PIPE, stderr=self.stderr,
            stdin=subprocess.PIPE if handshake else subprocess.DEVNULL,
            text=True, bufsize=1, start_new_session=True)
        _Worker.current = self

    def events(self):
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)

    def reply(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def finish(self, what: str) -> None:
        rc = self.proc.wait()
        _Worker.current = None
        if rc != 0:
            self.stderr.seek(0)
            tail = self.stderr.read().strip().splitlines()[-15:]
            raise RuntimeError(f"{what} worker failed (exit {rc}):\n" + "\n".join(tail))


def _median_extra(events, is_special, skip_first: int) -> float | None:
    """Median step time of special steps minus that of ordinary ones, skipping compile-heavy
    early steps (the first ``skip_first`` steps of each process)."""
    special, plain = [], []
    for proc_events in events:
        for i, e in enumerate(proc_events):
            if i < skip_first:
                continue
            (special if is_special(e) else plain).append(e["dt"])
    if not special or not plain:
        return None
    return statistics.median(special) - statistics.median(plain)


def _prepare_demo_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"not a directory: {path}")
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, DEMO_MARKER)):
            raise UserError(f"{path} is not empty and was not created by the demo; "
                            "pass an empty or new --dir")
        try:
            shutil.rmtree(path)
        except OSError as e:
            raise UserError(f"cannot clear demo directory {path}: {e.strerror or e}") from None
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, DEMO_MARKER), "w") as f:
            f.write("created by overlap-ckpt demo; the demo clears this directory on its next run\n")
    except OSError as e:
        raise UserError(f"cannot write to {path}: {e.strerror or e}") from None


def _worker_env() -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    # All workers compile the same programs: share them through the persistent cache.
    env.setdefault("JAX_COMPILATION_CACHE_DIR",
                   os.path.join(tempfile.gettempdir(), f"overlap_ckpt_jax_cache_{os.getuid()}"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _follow(w: _Worker, out: _Progress, stage: str, steps: int, other=lambda e, commits: False):
    """The step and commit events of worker ``w`` as they arrive, progress shown; every
    other event goes to ``other(event, commits so far)``, which returns True to stop."""
    events, commits = [], []
    for e in w.events():
        if e["ev"] == "step":
            events.append(e)
            out.step(stage, e["t"], steps)
        elif e["ev"] == "commit":
            commits.append(e)
        elif other(e, commits):
            break
    out.end()
    return events, commits


def _reference_run(common: list[str], env: dict, out: _Progress, steps: int) -> dict[int, int]:
    """Stage 1: an uninterrupted run with the same checkpoint schedule; its losses by step."""
    scratch = tempfile.mkdtemp(prefix="overlap_ckpt_demo_reference_")
    try:
        w = _Worker(["--dir", os.path.join(scratch, "ckpt"), *common], env)
        events, _ = _follow(w, out, "reference", steps)
        w.finish("reference")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {e["t"]: e["loss"] for e in events}


def _killed_run(path: str, common: list[str], env: dict, out: _Progress, steps: int):
    """Stage 2: train into ``path`` until two checkpoints commit, then SIGKILL mid-window."""
    w = _Worker(["--dir", path, "--handshake", *common], env, handshake=True)
    killed = []

    def at_window(e, commits) -> bool:
        if e["ev"] != "wait":
            return False
        if len(commits) >= 2:
            killed.append(e)
            w.kill()
            return True
        w.reply("go")
        return False
    events, commits = _follow(w, out, "overlap", steps, at_window)
    if not killed:
        w.finish("overlap")
        raise RuntimeError("the training worker ended before it could be killed mid-window")
    w.proc.wait()
    _Worker.current = None
    return events, commits, killed[0]


def _resumed_run(path: str, common: list[str], env: dict, out: _Progress, steps: int):
    """Stage 3: resume from the latest committed step and train to the end."""
    w = _Worker(["--dir", path, "--resume", *common], env)
    resumed_from = []

    def at_resume(e, commits) -> bool:
        if e["ev"] == "error":
            raise RuntimeError(e["msg"])
        if e["ev"] == "resumed":
            resumed_from.append(e["step"])
        return False
    events, commits = _follow(w, out, "resumed", steps, at_resume)
    w.finish("resume")
    return events, commits, resumed_from[0] if resumed_from else None


def cmd_demo(args) -> int:
    if args.steps < 1 or args.interval < 1 or args.window < 1:
        raise UserError("--steps, --interval and --window must be >= 1")
    if args.window > args.interval:
        raise UserError(f"--window {args.window} does not fit --interval {args.interval}")
    if args.steps < 3 * args.interval + 1:
        raise UserError(f"--steps must be > 3 x --interval ({3 * args.interval}) so that two "
                        "checkpoints commit before the kill")
    out = _Progress(args.quiet)
    path = args.dir
    _prepare_demo_dir(path)
    out.line(f"demo directory: {os.path.abspath(path)}")
    env = _worker_env()
    common = ["--steps", str(args.steps), "--interval", str(args.interval), "--window", str(args.window)]
    started = time.perf_counter()

    out.line(f"[1/3] reference run ({args.steps} steps, uninterrupted, a checkpoint every "
             f"{args.interval} steps)")
    reference = _reference_run(common, env, out, args.steps)
    out.line(f"[2/3] training with overlapped checkpoints (window K={args.window}) until SIGKILL mid-window")
    run1, commits, killed = _killed_run(path, common, env, out, args.steps)
    n_before = len(commits)
    out.line(f"      killed (SIGKILL) after step {killed['t']}: phase {killed['phase'] + 1}/"
             f"{args.window} of the window for step {killed['version']}")
    from ..storage import CheckpointStore

    store = CheckpointStore(path, read_only=True)
    latest, incomplete = store.latest_step(), store.incomplete_steps()
    store.close()
    out.line(f"[3/3] resuming from committed step {latest}"
             + (f" (incomplete step {incomplete} ignored)" if incomplete else ""))
    run2, resumed_commits, resumed_from = _resumed_run(path, common, env, out, args.steps)
    commits += resumed_commits
    _print_summary(args, commits, n_before, killed, resumed_from, run1, run2, started)
    mismatches = [e["t"] for e in run2 if reference.get(e["t"]) != e["loss"]]
    expected = list(range(resumed_from, args.steps)) if resumed_from is not None else []
    got_steps = [e["t"] for e in run2]
    if got_steps != expected or mismatches or resumed_from is None:
        detail = f"first differing step {mismatches[0]}" if mismatches else \
            f"resumed steps {got_steps[:3]}... expected {expected[:3]}..."
        print(f"resume FAILED: losses differ from the reference ({detail})", file=sys.stderr)
        return 1
    print(f"resume verified: bitwise identical losses for steps {resumed_from}..{args.steps - 1} "
          f"({len(run2)} steps)")
    return 0


def _print_summary(args, commits, n_before, killed, resumed_from, run1, run2, started) -> None:
    k = args.window
    stall = _median_extra([run1, run2], lambda e: e["phase"] is not None, skip_first=args.interval + 1)
    total_bytes = sum(c["nbytes"] for c in commits)
    total_s = sum(c["persist_s"] for c in commits)
    fmt = (lambda s: "n/a" if s is None else f"{s * 1e3:+.1f} ms")
    steps_str = (lambda cs: ", ".join(str(c["step"]) for c in cs) or "-")
    print("")
    print("summary")
    print(f"  checkpoints committed : {len(commits)} (before kill: {steps_str(commits[:n_before])}; "
          f"after resume: {steps_str(commits[n_before:])})")
    print(f"  window K              : {k} steps, every {args.interval} steps")
    print(f"  killed at step        : {killed['t']} (mid-window for step {killed['version']})")
    print(f"  resumed from step     : {resumed_from}")
    print(f"  stall per checkpoint  : {fmt(stall)} per window step (x{k} = "
          f"{fmt(None if stall is None else stall * k)}; median extra step time)")
    if total_s > 0:
        print(f"  persist throughput    : {total_bytes / total_s / 1e6:.1f} MB/s "
              f"({_mb(total_bytes / len(commits))} per checkpoint)")
    print(f"  wall time             : {time.perf_counter() - started:.1f} s")


# -- simulate --------------------------------------------------------------------------------
def _count(text: str) -> float:
    """``7e9``, ``7B``, ``350M``, ``1.5T`` -> a number."""
    t = text.strip()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower())
    try:
        return float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7e9, 7B, 350M)") from None


def cmd_simulate(args) -> int:
    from . import simulate

    rows = []
    try:
        for params in args.params:
            for n in args.accelerators:
                rows += simulate.simulate(
                    params, n, step_time_s=args.step_time, hardware=args.hardware,
                    d2h_gbps=args.d2h_gbps, persist_gbps=args.persist_gbps,
                    accelerators_per_node=args.accelerators_per_node,
                    overlappable_fraction=args.overlappable_fraction,
                    state_bytes_per_param=args.state_bytes_per_param,
                    grad_bytes_per_param=args.grad_bytes_per_param, replay_gbps=args.replay_gbps,
                    intervals=args.intervals, max_k=args.max_k)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(simulate.format_simulation_table(rows))
    return 0


def cmd_aot(args) -> int:
    import jax

    if args.target != "gpu":
        # Compiling needs no accelerator: keep jax's runtime on the CPU so the CUDA plugin
        # registers without a GPU (its runtime check is skipped) and libtpu claims no chip.
        jax.config.update("jax_platforms", "cpu")
    # The report reads what the compiler dumps while it compiles; a persistent compilation
    # cache the user has set (JAX_COMPILATION_CACHE_DIR) would answer from an earlier compile
    # of the same program, with nothing dumped: every program here is compiled.
    jax.config.update("jax_enable_compilation_cache", False)
    from ..aot import TargetError, get_target

    if args.step and (args.measure or args.profile or args.model or args.batch_per_device):
        raise UserError("--step names your own step, compiled only: --model, --batch-per-device, --measure and "
                        "--profile are the benchmark LM's")
    if args.mesh_shape and not args.step:
        raise UserError("--mesh-shape places the arguments of --step on the target's devices: use it with --step")
    if args.measure and args.target not in ("cpu", "gpu"):
        raise UserError("--measure runs the programs, so it needs the device: use it with --target cpu, "
                        "or --target gpu on a machine with a GPU")
    if args.profile and not (args.measure and args.target == "gpu"):
        raise UserError("--profile traces the measured programs: use it with --target gpu --measure")
    if args.copy_hints and args.target not in ("h100", "gpu"):
        raise UserError("--copy-hints is XLA:GPU's copy schedule hint: use it with --target h100 or gpu")
    step = _load_step(args) if args.step else None  # before the target: a bad --step fails at once
    try:
        target = get_target(args.target, host_gbps=args.host_gbps)
    except TargetError as e:
        raise UserError(str(e)) from None
    def write(text: str) -> None:
        if args.output:
            with open(args.output, "w") as f:
                f.write(text)

    log = (lambda line: print(line, file=sys.stderr))
    if args.step:
        text, violations = _aot_step(args, *step, target, log)
    else:
        from .aot.benchmark import aot_report

        text, windows = aot_report(target, args.model or "1b", args.k, tuple(args.intervals),
                                   args.batch_per_device or 4, log=log, measure=args.measure,
                                   on_progress=write, profile_dir=args.profile, copy_hints=args.copy_hints)
        violations = {k: w.violations() for k, w in windows.items()}
    write(text)
    print(text)
    failed = [k for k, found in violations.items() if found]
    if args.check and failed:
        print(f"overlap-ckpt: check failed for K={failed} (see Checks)", file=sys.stderr)
        return 1
    return 0


def _load_step(args) -> tuple:
    """``--step`` and ``--mesh-shape``, read (the user's set-up code runs here)."""
    from ..aot import StepError
    from .aot.step_cli import load_step, parse_mesh_shape

    try:
        return load_step(args.step), parse_mesh_shape(args.mesh_shape)
    except StepError as e:
        raise UserError(str(e)) from None


def _aot_step(args, user, mesh_shape, target, log) -> tuple[str, dict]:
    """``--step``: the user's own step, reported as ``CheckpointManager.aot_report`` reports it."""
    from ..aot import PlacementError, StepError
    from .aot.step_cli import step_report

    try:
        report = step_report(user, target, ks=args.k, intervals=tuple(args.intervals), copy_hints=args.copy_hints,
                             mesh_shape=mesh_shape, log=log)
    except (StepError, PlacementError) as e:
        raise UserError(str(e)) from None
    return report.markdown(), report.violations


# -- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overlap-ckpt",
                                description="Overlapped (GoCkpt-style) checkpointing for JAX/Flax.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,inspect,verify,simulate,aot}")
    d = sub.add_parser("demo", help="train, kill mid-window, resume, and check bitwise equality")
    d.add_argument("--dir", default=DEFAULT_DEMO_DIR, help=f"checkpoint directory (default {DEFAULT_DEMO_DIR})")
    d.add_argument("--steps", type=int, default=120)
    d.add_argument("--interval", type=int, default=20)
    d.add_argument("--window", type=int, default=3)
    d.add_argument("--quiet", action="store_true", help="no progress line")
    d.set_defaults(func=cmd_demo)
    i = sub.add_parser("inspect", help="list steps, sizes and the latest step's tree")
    i.add_argument("dir", metavar="DIR")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("verify", help="read every chunk and check its checksum")
    v.add_argument("dir", metavar="DIR")
    v.add_argument("--step", type=int, default=None)
    v.set_defaults(func=cmd_verify)
    s = sub.add_parser("simulate", help="cost-model stall and ETTR of sync, async, overlap K=1 and auto-K")
    s.add_argument("--params", type=_count, nargs="+", required=True, metavar="P",
                   help="model parameter counts (7e9, 7B, 350M...)")
    s.add_argument("--accelerators", type=int, nargs="+", default=[8], metavar="N",
                   help="accelerator counts; state and gradient are sharded over them (default 8)")
    s.add_argument("--step-time", type=float, default=1.0, help="seconds per training step (default 1.0)")
    s.add_argument("--hardware", default="h100-pcie5", help="link-speed preset (h100-pcie5, a100-pcie4)")
    s.add_argument("--d2h-gbps", type=float, default=None, help="device->host GB/s per accelerator")
    s.add_argument("--persist-gbps", type=float, default=None, help="storage GB/s per node")
    s.add_argument("--accelerators-per-node", type=int, default=None)
    s.add_argument("--overlappable-fraction", type=float, default=0.9)
    s.add_argument("--state-bytes-per-param", type=float, default=16.0)
    s.add_argument("--grad-bytes-per-param", type=float, default=2.0)
    s.add_argument("--replay-gbps", type=float, default=None, help="host replay GB/s per accelerator")
    s.add_argument("--intervals", type=int, nargs="+", default=[10, 50], help="checkpoint every N steps")
    s.add_argument("--max-k", type=int, default=16)
    s.set_defaults(func=cmd_simulate)
    a = sub.add_parser("aot", help="compile a benchmark model's or your own step's window programs for an "
                                   "H100 or a TPU slice without one; report copies, memory, predicted stall")
    a.add_argument("--target", required=True,
                   help="h100, a TPU topology such as v5e:2x2, v6e:2x2 (compile-only), cpu, or gpu (this machine's)")
    a.add_argument("--model", default=None, choices=sorted(LMConfig.PRESETS), help="benchmark LM preset (default 1b)")
    a.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                   help="your own step instead of a benchmark LM: FUNCTION() (no arguments) returns "
                        "overlap_ckpt.aot.UserStep(step, args, kwargs, model=, graphdef=) or (step, args); "
                        "MODULE is importable from here, or a path/to/file.py (docs/aot.md)")
    a.add_argument("--mesh-shape", default=None, metavar="AXIS=SIZE,...",
                   help="with --step: the size of each axis of the arguments' mesh on the target (default: the "
                        "same shape when the device counts match, else the largest axis takes every device)")
    a.add_argument("--k", type=int, nargs="+", action="extend", default=None,
                   help="window sizes to compile (default: 1, what window='auto' picks, the best); "
                        "--k 1 2 and --k 1 --k 2 alike")
    a.add_argument("--intervals", type=int, nargs="+", default=[10, 50], help="checkpoint every N steps")
    a.add_argument("--batch-per-device", type=int, default=None, help="benchmark LM's batch (default 4)")
    a.add_argument("--host-gbps", type=float, default=None, help="device->host GB/s per device")
    a.add_argument("--output", default=None, help="also write the markdown report here")
    a.add_argument("--check", action="store_true", help="exit 1 when a window program fails the check")
    a.add_argument("--measure", action="store_true",
                   help="cpu and gpu targets: also run the programs here and set them beside the prediction")
    a.add_argument("--profile", default=None, metavar="DIR",
                   help="with --target gpu --measure: a profiler trace of the plain step and each K's largest "
                        "phase, written to DIR (when each copy runs within the step)")
    a.add_argument("--copy-hints", action="store_true",
                   help="h100 and gpu: the step jitted with CheckpointManager.jit_compiler_options() and its "
                        "window variants compiled as compile_ahead does (per-leaf copies, a latency profile "
                        "for every capturing phase)")
    a.set_defaults(func=cmd_aot)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _Worker.current is not None:
            _Worker.current.kill()
        step = _last_committed(args.dir) if hasattr(args, "dir") else None
        print(f"\ninterrupted; last committed step: {'none' if step is None else step}", file=sys.stderr)
        return 130
    except UserError as e:
        print(f"overlap-ckpt: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001
        from ..storage import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"overlap-ckpt: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        if isinstance(e, RuntimeError):
            print(f"overlap-ckpt: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
