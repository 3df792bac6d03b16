"""Smoke test of the side-by-side benchmark (``python -m benchmarks.run``) at tiny size.

No performance thresholds: it checks that every configuration runs and reports, and that the
Markdown report (and, with matplotlib installed, the timeline plot) is written, and that
``benchmarks.trace_host`` reads the profiler traces it writes. The storage
benchmark's cache eviction is checked against the kernel's own count of cached pages, and its
split of a persist into phases against a stall injected in one of them, and the dispatch
benchmark's count of full garbage collections against collections run on purpose.
"""

import gc
import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import REPO

from benchmarks import trace_host
from benchmarks.bench_dispatch import FullCollections
from benchmarks.run import DEFAULT_CONFIGS


@pytest.mark.slow
def test_benchmark_run_tiny(tmp_path):
    out = tmp_path / "tiny"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--model", "tiny", "--steps", "24",
                        "--intervals", "8", "--restore-repeats", "1", "--raw-repeats", "1",
                        "--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt"), "--profile", str(tmp_path / "prof")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert report["baseline"]["config"] == "none" and report["baseline"]["median_step_s"] > 0
    got = {(x["config"], x["interval"]) for x in report["results"]}
    assert got == {(c, 8) for c in DEFAULT_CONFIGS}
    for x in report["results"]:
        if x["config"] == "overlap_idle":  # the per-step tax alone: no window is ever reached
            assert x["checkpoints_measured"] == 0 and x["median_plain_step_s"] > 0
            continue
        if x["config"] == "raw_beside":  # the persist target's reference: writes, no checkpoint
            assert x["committed"] >= 1 and x["persist_gibps"] > 0 and x["prediction"] is None
            continue
        assert x["checkpoints_measured"] >= 1, x["config"]
        # N=8, 24 steps: every checkpoint is followed by plain steps, so each offset has a figure
        assert len(x["extra_after_ckpt_s"]) == 3 and None not in x["extra_after_ckpt_s"], x["config"]
        assert x["prediction"] is not None and 0 < x["prediction"]["ettr"] <= 1
        assert x.get("restore_s") is not None, x["config"]
    assert report["baseline"]["compile_s"] > 0 and all(x["compile_s"] > 0 for x in report["results"])
    # --profile: a trace of the first measured window of every overlap run that reaches one
    traces = (tmp_path / "prof").glob("*/plugins/profile/*/*.trace.json.gz")
    traced = {trace.relative_to(tmp_path / "prof").parts[0] for trace in traces}
    assert traced == {f"{c}_N8" for c in DEFAULT_CONFIGS if c.startswith("overlap") and c != "overlap_idle"}, traced
    # benchmarks.trace_host reads them: each traced step (the K=3 window and the 3 after it),
    # each followed by the freeing of the state it was given (donated: the same arrays each
    # step, as many as a plain step frees). A window step's outbox is freed by whichever
    # thread drops it last, the training thread's or the engine's: seen once, 12 arrays more
    # after a window step (111 and 123), so a window step frees at least as many.
    rows = trace_host.analyse(trace_host.load_trace(str(tmp_path / "prof" / "overlap_k3_N8")))
    assert len(rows) == 3 + 3, rows
    plain = {r["freed"] for r in rows[3:]}
    assert len(plain) == 1 and min(plain) > 0, rows
    assert all(r["freed"] >= min(plain) for r in rows[:3]), rows
    k = {x["config"]: x.get("k") for x in report["results"]}
    assert k["overlap_k1"] == 1 and k["overlap_k3"] == 3 and k["overlap_auto"] == 1  # auto: 1 on CPU
    assert len(report["targets"]) == 6 + len(report["intervals"])  # one ETTR target per interval
    md = (tmp_path / "tiny.md").read_text()
    for label in ("no checkpointing", "Orbax sync", "Orbax async", "overlap, no window reached", "overlap K=1",
                  "overlap auto-K", "overlap K=3", "non-window step", "compile", "persist beside training",
                  "restore >= 2x Orbax", "ETTR >= Orbax async's at N=8", "raw write beside training",
                  "of a raw fsync'd write beside the same training", "steps after it: +1..+3",
                  "dispatch ms: other steps / +1"):
        assert label in md, label
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "tiny_timeline.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_interval_tiny(tmp_path):
    """Every measured block with checkpointing on committed the checkpoints its interval
    asks for and every block with it off committed none (overlap: persisted steps; Orbax:
    saves taken), and the per-checkpoint figures exist."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_interval", "--model", "tiny", "--intervals", "2", "4",
                        "--block", "8", "--rounds", "2", "--out", str(tmp_path / "interval")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "interval.json").read_text())
    assert set(report["rows"]) == {"overlap N=2", "overlap N=4", "orbax async N=2", "orbax async N=4"}
    for name, rows in report["rows"].items():
        n = report["summary"][name]["n"]
        assert [(row["on"], row["ckpts"]) for row in rows] == [(True, 8 // n), (False, 0), (False, 0), (True, 8 // n)], name
        assert report["summary"][name]["per_ckpt_total_s"] is not None
        # Blocks start at step 2: at N=2 and N=4 both loss-fetch segments (5 steps, then 3)
        # hold a step that reads a checkpoint's version, so no segment is left for "other".
        assert report["summary"][name]["other_segments_s"] == 0, name
        assert report["summary"][name]["ckpt_segments_s"] != 0, name
    assert [len(report["summary"][f"overlap N={n}"]["orbax_minus_this_by_round_s"]) for n in (2, 4)] == [2, 2]
    text = (tmp_path / "interval.md").read_text()
    assert "total cost per checkpoint at N=4" in text and "checkpoint's segment per checkpoint at N=4" in text
    assert "overlap N=4 against Orbax async, round by round" in text


def test_cli_simulate():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "overlap_ckpt.tools.cli", "simulate", "--params", "7B",
                        "--accelerators", "8", "--step-time", "2"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "overlap auto-K" in r.stdout and "ETTR @10" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "overlap_ckpt.tools.cli", "simulate", "--params", "7B",
                          "--intervals", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error" in bad.stderr


def test_bench_interval_compares_with_orbax_within_each_round():
    """Round by round, Orbax's cost per checkpoint minus overlap's, each from its own on and
    off blocks of that round: here round 0 drifted 2 s slower for both, which the
    difference cancels."""
    from benchmarks.bench_interval import summarize

    def block(r, on, block_s, ckpts=2):
        return {"round": r, "on": on, "first_step": 0, "block_s": block_s, "drain_s": 0.1 if on else 0.0,
                "ckpts": ckpts if on else 0, "cpu_s": 0.0, "minor_faults": 0, "sync_s": [5.0, 10.0]}

    rows = {"overlap N=10": [block(0, True, 12.2), block(0, False, 12.0), block(1, False, 10.0), block(1, True, 10.4)],
            "orbax async N=10": [block(0, True, 13.0), block(0, False, 12.0), block(1, False, 10.0),
                                 block(1, True, 10.7)]}
    summary = summarize({"rows": rows, "rounds": 2, "block": 10, "sync_every": 5})
    # overlap: (12.3 - 12.0) / 2 = 0.15 and (10.5 - 10.0) / 2 = 0.25; Orbax: 0.55 and 0.4.
    assert summary["overlap N=10"]["orbax_minus_this_by_round_s"] == pytest.approx([0.4, 0.15])
    assert summary["orbax async N=10"]["orbax_minus_this_by_round_s"] is None


def test_bench_interval_spill_after_the_checkpoint_cancels_the_blocks_drift():
    """The segments after a mid-block checkpoint, set against those before it in the same
    block: round 0's on block runs 0.2 s per segment slower throughout (drift) and the two
    segments after the checkpoint 0.3 and 0.1 s more; round 1's runs 0.1 s faster and the
    first segment after 0.1 s more. At N=10 no segment is left before the first checkpoint."""
    from itertools import accumulate

    from benchmarks.bench_interval import markdown, summarize

    def block(r, on, segments, ckpts):
        return {"round": r, "on": on, "first_step": 15, "block_s": sum(segments), "drain_s": 0.0,
                "ckpts": ckpts if on else 0, "cpu_s": 0.0, "minor_faults": 0, "sync_s": list(accumulate(segments))}

    off = [1.0] * 6  # 30 steps from step 15, loss every 5: the N=30 checkpoint (step 30) is in segment 3
    rounds = [[1.2, 1.2, 1.2, 1.7, 1.5, 1.3], [0.9, 0.9, 0.9, 1.4, 1.0, 0.9]]
    rows = {"overlap N=30": [block(0, True, rounds[0], 1), block(0, False, off, 1),
                             block(1, False, off, 1), block(1, True, rounds[1], 1)],
            "overlap N=10": [block(0, True, rounds[0], 3), block(0, False, off, 3),
                             block(1, False, off, 3), block(1, True, rounds[1], 3)]}
    report = {"rows": rows, "rounds": 2, "block": 30, "sync_every": 5}
    summary = summarize(report)
    assert summary["overlap N=30"]["spill_after_by_round_s"] == pytest.approx([0.4, 0.1])
    assert summary["overlap N=10"]["spill_after_by_round_s"] is None
    text = markdown(report | {"model": "tiny", "window": 1, "loadavg_at_end": [1.0], "summary": summary})
    assert ("overlap N=30: the segments after the checkpoint, against those before it in the same block, "
            "add 250 ms per checkpoint (median over rounds; 100 to 400; more in 2 of 2 rounds)") in text
    assert "overlap N=10: the segments after" not in text


def test_bench_interval_ratio_of_a_drifted_cost_is_not_resolved():
    """A cost per checkpoint at or below zero is drift between blocks (a checkpoint never
    speeds a loop up): the report says so instead of printing a ratio to it."""
    from benchmarks.bench_interval import markdown

    def row(n, total, segment):
        return {"n": n, "block_on_s_median": 30.0, "block_off_s_median": 30.0, "per_ckpt_training_s": total,
                "per_ckpt_total_s": total, "cpu_s_per_ckpt": 0.0, "minor_faults_per_ckpt": 0.0,
                "ckpt_segments_s": segment, "other_segments_s": 0.0}

    report = {"model": "20m", "rounds": 6, "block": 50, "sync_every": 5, "window": 3, "loadavg_at_end": [2.0],
              "summary": {"overlap N=10": row(10, 0.002, 0.181), "overlap N=50": row(50, -0.98, 0.092)}}
    text = markdown(report)
    assert "total cost per checkpoint at N=50 against N=10: not resolved" in text
    assert "-490.00x" not in text and "x the one at N=10 (target" in text  # the segment's ratio stays
    assert "checkpoint's segment per checkpoint at N=50 is 0.51x the one at N=10" in text

    # With --checksums both, each kind of overlap loop is set against its own other interval.
    report["summary"] |= {"overlap, no checksums N=10": row(10, 0.1, 0.1),
                          "overlap, no checksums N=50": row(50, 0.3, 0.05)}
    text = markdown(report)
    assert "overlap, no checksums: total cost per checkpoint at N=50 is 3.00x the one at N=10" in text
    assert "overlap: total cost per checkpoint at N=50 against N=10: not resolved" in text


def test_bench_interval_without_syncs_splits_a_checkpoints_cost_by_call_and_thread():
    """--sync-every 0 (a loop that never syncs): each block is one loss-fetch segment, and
    the breakdown is per checkpoint, on minus off, for the training thread's calls and for
    each thread group's CPU seconds (a group seen in one block only counts as 0 in the other)."""
    from benchmarks.bench_interval import markdown, summarize

    def block(r, on, spent, cpu):
        return {"round": r, "on": on, "first_step": 25, "block_s": 10.0 + spent, "drain_s": 0.0,
                "ckpts": 1 if on else 0, "cpu_s": 0.0, "minor_faults": 0, "sync_s": [10.0 + spent],
                "dispatch_s": 1.0, "checkpointer_s": spent, "fetch_s": 9.0, "thread_cpu_s": cpu}

    rows = {"overlap N=50": [block(0, True, 0.3, {"training": 1.5, "persist": 0.4}), block(0, False, 0.0, {"training": 1.0}),
                             block(1, False, 0.0, {"training": 1.0}), block(1, True, 0.1, {"training": 1.1, "persist": 0.2})]}
    report = {"rows": rows, "rounds": 2, "block": 50, "sync_every": 0}
    summary = summarize(report)["overlap N=50"]
    assert summary["training_thread_per_ckpt_s"] == pytest.approx({"dispatch_s": 0.0, "checkpointer_s": 0.2,
                                                                   "fetch_s": 0.0})
    assert summary["thread_cpu_s_per_ckpt"] == pytest.approx({"training": 0.3, "persist": 0.3})
    assert summary["ckpt_segments_s"] == pytest.approx(0.2) and summary["other_segments_s"] == 0
    text = markdown(report | {"model": "20m", "window": 1, "loadavg_at_end": [1.0],
                              "summary": {"overlap N=50": summary}})
    assert "no sync of any kind inside a block" in text
    assert "| overlap N=50 | 50 | 0 | 200 | 0 | 300 | 300 |" in text


def test_thread_cpu_counts_each_named_thread_in_its_group():
    """CPU seconds by thread group, from /proc: a library thread that burns 0.3 s of CPU is
    counted under its job's name, and the training thread, which only waits, is not
    charged for it."""
    import time

    from benchmarks import thread_cpu

    burnt, finish = threading.Event(), threading.Event()

    def replay():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        burnt.set()
        finish.wait(10)  # alive at the second reading: a thread that ended is seen by neither

    worker = threading.Thread(target=replay, name="overlap-ckpt-replay")
    before = thread_cpu.read()
    worker.start()
    burnt.wait(30)
    spent = thread_cpu.by_group(before, thread_cpu.read())
    finish.set()
    worker.join()
    assert spent["replay"] >= 0.28 and spent.get("training", 0.0) < 0.2, spent


def resident_pages(path) -> int:
    """Pages of the file ``path`` in the page cache, as the kernel says (``mincore`` of a
    read-only mapping of it)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapping:
        view = np.frombuffer(mapping, np.uint8)
        status = libc.mincore(view.ctypes.data, size, vec)
        del view
    assert status == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


def test_drop_cache_evicts_a_file_and_every_file_of_a_directory(tmp_path):
    """The storage benchmark's cold reads: a file named itself is evicted too (it was not,
    and the raw read's "cold" figures were page-cache reads)."""
    from benchmarks.bench_storage import drop_cache

    (tmp_path / "d" / "sub").mkdir(parents=True)
    files = [tmp_path / "raw.bin", tmp_path / "d" / "a.bin", tmp_path / "d" / "sub" / "b.bin"]
    for f in files:
        f.write_bytes(os.urandom(1 << 20))
        f.read_bytes()
        assert resident_pages(f) > 0, f
    drop_cache(str(tmp_path / "raw.bin"))
    assert resident_pages(files[0]) == 0
    assert all(resident_pages(f) > 0 for f in files[1:])
    drop_cache(str(tmp_path / "d"))
    assert [resident_pages(f) for f in files] == [0, 0, 0]


def test_persist_phases_attribute_time_to_the_stage_it_was_spent_in(tmp_path):
    """The storage benchmark splits each persist by the store's stage hooks; time spent
    between two stages (here a stall after the first array's writes are issued) must land in
    that phase alone, and the phases add up to at most the persist's time. Read off a clock
    that counts readings (a stall adds 1000), so that a loaded machine moves no phase: the
    wall clock once put 3.4 s of a busy CI machine into the tail."""
    import numpy as np

    from benchmarks.bench_storage import PHASES, PhaseMarks, persist_phases
    from overlap_ckpt.storage import CheckpointStore, set_fault_hook

    now, lock = [0.0], threading.Lock()

    def clock() -> float:
        with lock:
            now[0] += 1
            return now[0]

    marks, stalled = PhaseMarks(clock), []

    def hook(stage, info):
        marks(stage, info)
        if stage == "array_write" and not stalled:
            stalled.append(stage)
            with lock:
                now[0] += 1000

    store = CheckpointStore(tmp_path / "ck")
    previous = set_fault_hook(hook)
    try:
        saved_at = clock()
        store.save(1, {"w": np.ones((256, 256), np.float32), "b": np.zeros(256, np.float32)})
        store.wait_until_finished()
        elapsed = clock() - saved_at
    finally:
        set_fault_hook(previous)
        store.close()
    phases = persist_phases(saved_at, marks.marks)
    assert list(phases) == list(PHASES) and all(v >= 0 for v in phases.values()), phases
    assert phases["data"] >= 1000 and max(phases["queue"], phases["setup"], phases["tail"]) < 1000, phases
    assert sum(phases.values()) <= elapsed


def test_dispatch_counts_the_full_collections_of_every_thread_once_started():
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections run here: none triggered by allocation meanwhile
    try:
        with FullCollections() as full:
            gc.collect()  # before counting starts
            full.counting = True
            gc.collect(1)  # a young collection
            thread = threading.Thread(target=gc.collect)  # a full one, on another thread
            thread.start()
            thread.join()
            gc.collect()
        gc.collect()  # after the block
    finally:
        if was_enabled:
            gc.enable()
    assert len(full.pauses_s) == 2 and all(p > 0 for p in full.pauses_s)
