"""One configuration of ``benchmarks.run``, trained and measured in a process of its own.

    python -m benchmarks.run_worker SPEC_JSON   # started by benchmarks.run; prints one JSON line

Why a process per configuration: its peak RSS (VmHWM) is then its own, and no compiled
program or cache carries over from the configuration before it. The worker trains the LM of
``benchmarks.lm_loop`` under one configuration (``run_configs.CONFIGS``) at one interval,
unmeasured through the first checkpoint, then times every step, the final wait and the
restores (see benchmarks/README.md, "What runs"); the driver analyses what it returns.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable

from benchmarks.harness import rss_now, rss_peak, run_fresh, tree_bytes
from benchmarks.run_configs import COPY_HINT, GIB, WINDOWS

_T0 = time.perf_counter()  # process start (a worker's wall time includes imports and compiles)


def worker_env(platform_name: str, cache_dir: str | None) -> dict:
    """The environment of a worker process: the platform, quiet logs, no preallocation of
    device memory (so RSS and device memory are per run) and, when ``cache_dir`` is given, a
    compilation cache that configurations share (then compile times mean nothing)."""
    env = dict(os.environ)
    if platform_name == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if cache_dir:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(spec: dict, env: dict, timeout: float | None) -> dict:
    """Train and measure ``spec`` in a fresh process; its measurements."""
    return run_fresh("benchmarks.run_worker", [json.dumps(spec)], env=env, timeout=timeout,
                     label=f"{spec['config']} N={spec['interval']}")


def raw_write_arrays(state_bytes: int) -> list:
    """``state_bytes`` of transformer-shaped float32 arrays: what the raw writes write."""
    from benchmarks.bench_storage import leaves_of, make_state

    return leaves_of(make_state(state_bytes / GIB, n_layers=4))


def _time_compiles_on_this_thread() -> Callable[[], float]:
    """Start summing the time this thread spends tracing, lowering and compiling (JAX's own
    monitoring events); returns a function giving the total so far."""
    from jax import monitoring

    me = threading.get_ident()
    total = [0.0]
    events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def listener(name, secs, **kwargs):
        if name in events and threading.get_ident() == me:
            total[0] += secs

    monitoring.register_event_duration_secs_listener(listener)
    return lambda: total[0]


class RawWriterBeside:
    """The ``raw_beside`` configuration's writer: at a checkpoint step, the state's bytes
    written to one file and fsync'd by a background thread, as a checkpointer's background
    persist runs beside training. A step that finds the previous write still running writes
    nothing (like a checkpointer that would skip it), so writes never queue."""

    def __init__(self, directory: str, state_bytes: int):
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, "raw_write.bin")
        self._arrays = raw_write_arrays(state_bytes)
        self._thread: threading.Thread | None = None
        self.records: list[dict] = []  # as CheckpointStore.history: step, nbytes, persist_s, start

    def start(self, step: int) -> bool:
        """Write the bytes for ``step`` in the background; False when the last write still runs."""
        from benchmarks.bench_storage import raw_write

        if self._thread is not None and self._thread.is_alive():
            return False

        def write() -> None:
            t0 = time.perf_counter()
            raw_write(self._path, self._arrays)
            self.records.append({"step": step, "nbytes": sum(a.nbytes for a in self._arrays), "queued_s": 0.0,
                                 "persist_s": time.perf_counter() - t0, "start": t0})

        self._thread = threading.Thread(target=write, name="raw-write-beside", daemon=True)
        self._thread.start()
        return True

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def worker(spec: dict) -> dict:
    """Train one configuration; return its measurements (JSON-serialisable)."""
    import jax
    import numpy as np
    import optax

    import overlap_ckpt as oc

    from benchmarks.lm_loop import lm_loop

    cfg_name, n = spec["config"], spec["interval"]
    backend = jax.default_backend()
    if spec["platform"] == "gpu" and backend != "gpu":
        raise RuntimeError(f"--platform gpu but JAX's default backend is {backend!r}")
    lm = lm_loop(spec["model"], spec["batch_size"], spec["distinct_batches"])
    config, batches, train_step = lm.config, lm.batches, lm.train_step
    tx = optax.adamw(1e-3, weight_decay=0.01)
    if spec.get("optimizer") == "clip_adamw":
        tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    compile_s = _time_compiles_on_this_thread()
    # Training starts at step counter s0 (a few steps before the first checkpoint) so that the
    # warm-up is short whatever N is; only adamw's bias correction sees the counter.
    s0 = spec.get("start_step", 0)
    state = lm.fresh_state(tx, s0)
    param_bytes = tree_bytes(state.params)
    state_bytes = param_bytes + tree_bytes(state.opt_state) + 4  # + the int32 step

    def tree_of(s):
        return {"step": s.step, "params": s.params, "opt_state": s.opt_state}

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    ckpt_dir = os.path.join(spec["ckpt_root"], f"{cfg_name}_N{n}")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    mngr = omngr = None
    if cfg_name.startswith("overlap"):
        # overlap_idle: a manager whose interval is never reached (the per-step tax alone)
        interval = 10**9 if cfg_name == "overlap_idle" else n
        store = oc.storage.CheckpointStore(ckpt_dir, max_to_keep=2, copy_threads=spec.get("copy_threads"))
        mngr = oc.CheckpointManager(save_interval_steps=interval, window=WINDOWS[cfg_name], store=store,
                                    persist_bytes_per_s=spec.get("persist_bytes_per_s") or 1e9,
                                    on_host_budget=spec.get("on_host_budget", "wait"))
        state = mngr.prepare(state)
        if cfg_name in COPY_HINT:
            train_step = lm.jit_step(mngr.jit_compiler_options())
        if spec.get("compile_ahead", True):
            mngr.compile_ahead(train_step, state, batches[0])  # window variants off this thread
    elif cfg_name.startswith("orbax"):
        import orbax.checkpoint as ocp
        omngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
            save_interval_steps=n, max_to_keep=2, enable_async_checkpointing=cfg_name == "orbax_async"))

    raw_writer = RawWriterBeside(ckpt_dir, state_bytes) if cfg_name == "raw_beside" else None

    def finish_wait():
        if raw_writer is not None:
            raw_writer.wait()
        if mngr is not None:
            mngr.wait_until_finished()
        if omngr is not None:
            omngr.wait_until_finished()

    warmup, steps = spec["warmup"], spec["steps"]
    # sync_every=1: every step ends with block_until_ready (per-step times are step times);
    # k > 1: the loop only fetches the loss every k steps, as real loops do, so dispatch runs
    # ahead and only the whole span's time means something (stall per checkpoint over the span).
    sync_every = spec.get("sync_every", 1)
    rows = []  # (t, phase/save flag, start, end, rss) of measured steps
    rss_before = rss_now()
    profiling = None  # --profile: the step range being traced
    for t in range(s0, s0 + warmup + steps):
        if spec.get("profile") and mngr is not None and profiling is None and t >= s0 + warmup \
                and mngr.next_window_phase == 0:
            profiling = range(t, t + mngr.engine.schedule.k + 3)  # the window and 3 steps after
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 1  # the host worker's Python beside the training thread's
            jax.profiler.start_trace(os.path.join(spec["profile"], f"{cfg_name}_N{n}"), profiler_options=options)
        if profiling is not None and t == profiling.stop:
            jax.profiler.stop_trace()
        if t == s0 + warmup:
            finish_wait()  # the warm-up checkpoint is not measured
            if mngr is not None:
                eng = mngr.engine
                eng.replay_seconds, eng.replayed_bytes, eng.windows_completed = 0.0, 0, 0
                eng.spans = []
                hist0 = len(mngr.store.history)
            if raw_writer is not None:
                raw_writer.records.clear()
        phase = mngr.next_window_phase if mngr is not None else None
        batch = batches[t % len(batches)]
        start = time.perf_counter()
        state, loss = train_step(state, batch)
        save = False
        if mngr is not None:
            state = mngr.step(state)
        elif omngr is not None and (t + 1) % n == 0:
            # The state after step t is version t + 1 (the input of step t + 1), as for overlap.
            save = bool(omngr.save(t + 1, args=ocp.args.StandardSave(tree_of(state))))
        elif raw_writer is not None and (t + 1) % n == 0:
            save = raw_writer.start(t + 1)
        dispatched = time.perf_counter()  # the training thread has issued the step
        if sync_every == 1:
            jax.block_until_ready((state.params, state.opt_state, loss))
        elif (t + 1 - s0 - warmup) % sync_every == 0 or t == s0 + warmup + steps - 1:
            float(loss)  # what a loop that logs the loss every few steps waits for
        end = time.perf_counter()
        if t >= s0 + warmup:
            rows.append({"t": t, "phase": phase, "save": save, "start": start, "dispatched": dispatched, "end": end,
                         "rss": rss_now()})
    if profiling is not None and t < profiling.stop:
        jax.profiler.stop_trace()
    wait_start = time.perf_counter()
    finish_wait()
    final_wait_s = time.perf_counter() - wait_start
    peak = rss_peak()
    loss_final = float(loss)
    d2h = None
    if spec.get("measure_d2h"):  # after the RSS reading: its buffers are not the baseline's
        from overlap_ckpt.costmodel.hardware import measure_d2h_bandwidth
        d2h = measure_d2h_bandwidth(nbytes=int(min(max(state_bytes, 16 << 20), 256 << 20)))

    out: dict[str, Any] = {
        "wall_s": time.perf_counter() - _T0,
        "config": cfg_name, "interval": n, "backend": backend, "device": str(jax.devices()[0]),
        "num_params": int(config.num_params()), "param_bytes": param_bytes, "state_bytes": state_bytes,
        "start_step": s0, "warmup_steps": warmup, "steps": rows, "final_wait_s": final_wait_s, "final_loss": loss_final,
        "rss_before_train_bytes": rss_before, "rss_peak_bytes": peak, "d2h_bytes_per_s": d2h,
        "compile_s": compile_s(),
    }
    out["sync_every"] = sync_every
    if mngr is not None:
        eng = mngr.engine
        summary = mngr.summary()
        out["host_budget"] = {"text": str(summary), "limit_bytes": summary.limit_bytes, "delayed": summary.delayed,
                              "delay_s": summary.delay_seconds, "skipped": summary.skipped_steps}
        out["k"] = int(eng.schedule.k)
        out["replay_seconds"] = eng.replay_seconds
        out["replayed_bytes"] = int(eng.replayed_bytes)
        out["windows_completed"] = int(eng.windows_completed)
        out["windows_aborted"] = int(getattr(eng, "windows_aborted", 0))
        out["replay_spans"] = [list(s) for s in (eng.spans or [])]
        out["persist"] = [{"step": r.step, "nbytes": r.nbytes, "queued_s": r.queued_seconds,
                           "persist_s": r.persist_seconds, "start": getattr(r, "started_perf_s", 0.0)}
                          for r in mngr.store.history[hist0:]]
        out["saved_steps"] = mngr.all_steps()
    if omngr is not None:
        out["saved_steps"] = list(omngr.all_steps())
    if raw_writer is not None:
        out["persist"] = raw_writer.records

    # Restore the last step into the abstract state (warm page cache, as right after training).
    latest = None
    if mngr is not None:
        latest = mngr.latest_step()
    elif omngr is not None:
        latest = omngr.latest_step()
    if latest is not None:
        target = abstract(tree_of(state))
        times = []
        for _ in range(spec["restore_repeats"]):
            t0 = time.perf_counter()
            if mngr is not None:
                restored, _ = mngr.store.restore(latest, target=target)
            else:
                restored = omngr.restore(latest, args=ocp.args.StandardRestore(target))
            jax.block_until_ready(restored)
            times.append(time.perf_counter() - t0)
            ok = int(np.asarray(restored["step"])) == latest
            del restored
        out["restore_step"] = int(latest)
        out["restore_s"] = times
        out["restore_step_ok"] = bool(ok)
    if mngr is not None:
        mngr.close()
    if omngr is not None:
        omngr.close()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(worker(json.loads(argv[0]))))


if __name__ == "__main__":
    main()
