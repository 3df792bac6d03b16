"""Random-fault soak: ``python -m tests.faults.soak --minutes 60 [--seed 1]``.

Why: each fault test in this package tries one fault at one point; a soak tries them at
random points, over and over, to find the interleavings nobody wrote a test for. Until the
time is up it picks a fault, runs the training worker (tests/faults/worker.py) into it and
then checks the checkpoint directory against an independent reference:

* ``kill``: SIGKILL of the worker at a random storage stage of a random checkpoint (or right
  after a window's capture/replay was handed over); then a resume must go on bitwise;
* ``enospc``: a real full filesystem (a small tmpfs, by size or by inodes, in ``unshare -rm``);
  every failure must be an ``OutOfSpaceError``;
* ``readonly``: a resume on a root bind-mounted read-only must refuse to open (a
  ``CheckpointError`` naming EROFS), change nothing, and a resume afterwards go on bitwise;
* ``corrupt``: a random damage of tests/faults/damage.py on a random committed step: restore
  must raise exactly the documented class, the other steps must stay exact;
* ``s3_down``: the S3 endpoint (a local moto server behind tests/storage/s3_proxy.py) goes
  away mid-write of a random checkpoint and comes back after a random delay.

Verification never trusts the library's opinion of itself: every step stock Orbax lists is
restored by overlap_ckpt in this process *and* by stock Orbax in a subprocess without
overlap_ckpt (tests/loops/orbax_reader.py; for S3, on a copy of the steps that carry the
commit marker, Orbax's rule for object stores), and both are compared bit for bit with the
snapshots of an uninterrupted reference run of the same schedule.

Counts: ``lost`` = a step reported committed that is gone though fewer than ``KEEP`` newer
steps exist (retention could not have deleted it), or a step nobody damaged that no longer
restores; ``wrong`` = different bits, a damage or fault not reported with its documented
class, a step one reader lists and the other does not, or a resume that diverges. Prints
one line and exits 1 if lost or wrong > 0. Loopback only; one worker at a time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from overlap_ckpt.storage.hooks import STAGES  # the kill points

from . import worker
from .damage import DAMAGE

REPO = Path(__file__).resolve().parents[2]
STEPS = 18  # checkpoints at 4, 8, 12, 16 (worker.INTERVAL), the newest worker.KEEP kept
SAVE_STEPS = list(range(worker.INTERVAL, STEPS, worker.INTERVAL))
KINDS = ("kill", "enospc", "readonly", "corrupt", "s3_down")
TIMEOUT = 300  # one worker run; a hang is a finding, not a reason to soak forever


def path_key(keystr: str) -> tuple[str, ...]:
    """``"['opt_state'][0].mu['dense1']"`` -> ``('opt_state', '0', 'mu', 'dense1')``: the
    worker's snapshot keys in the form tests/loops/orbax_reader.py gives Orbax's leaves."""
    return tuple(a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", keystr))


class Soak:
    def __init__(self, base: Path, rng: random.Random, log):
        self.base, self.rng, self.log = base, rng, log
        self.kills = 0
        self.faults: collections.Counter = collections.Counter()
        self.ours = self.orbax = self.lost = self.wrong = 0
        self.committed_in: dict[str, set[int]] = {}  # directory -> distinct steps committed there
        self.findings: list[str] = []
        self.s3 = None
        self.snaps, self.ref_losses = self._reference()

    # -- reference and bookkeeping -----------------------------------------------------

    def _reference(self):
        """The uninterrupted run of the same schedule: losses and host snapshots at every save."""
        ref = self.base / "ref"
        ref.mkdir()
        code, evs, err = self._run_worker(self.base / "ref_ck", ["--ref-dir", str(ref)])
        if code != 0:
            raise SystemExit(f"soak: the reference run failed ({code}):\n{err[-3000:]}")
        snaps = {int(p.stem): {path_key(k): v for k, v in np.load(p).items()}
                 for p in ref.glob("[0-9]*.npz")}
        return snaps, {e["t"]: e["loss"] for e in evs if e["ev"] == "step"}

    def bad(self, counter: str, what: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        self.findings.append(f"{counter}: {what}")
        self.log(f"  !! {counter}: {what}")

    def _run_worker(self, directory, extra=(), env=None, wrap=(), steps=STEPS):
        """One worker subprocess to ``steps`` (``wrap``: a command prefix, e.g.
        ``unshare -rm sh -c ...``); returns (exit code, events, stderr)."""
        proc = worker.launch(directory, steps=steps, env=env, extra=extra, prefix=wrap)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self.bad("wrong", f"worker hung > {TIMEOUT}s: {directory} {list(extra)} {env}")
            return None, worker.events(out), err
        return proc.returncode, worker.events(out), err

    # -- verification --------------------------------------------------------------------

    def orbax_read(self, directory) -> dict | None:
        """Stock Orbax, in a process that never imports overlap_ckpt."""
        out = self.base / "orbax.pkl"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([sys.executable, str(REPO / "tests/loops/orbax_reader.py"), "--dir",
                               str(directory), "--out", str(out)], env=env, capture_output=True,
                              text=True, timeout=TIMEOUT)
        if proc.returncode != 0:
            self.bad("wrong", f"stock Orbax failed on {directory}: {proc.stderr.strip().splitlines()[-1:]}")
            return None
        with open(out, "rb") as f:
            return pickle.load(f)

    def same_as_reference(self, step: int, leaves: dict[tuple, np.ndarray]) -> bool:
        return worker.same_bits({"/".join(k): v for k, v in leaves.items()},
                                {"/".join(k): v for k, v in self.snaps[step].items()})

    def verify(self, directory, reported: set[int], *, orbax_dir=None) -> list[int]:
        """Check every step on storage with both readers; returns the steps stock Orbax lists.

        ``reported``: the steps workers reported committed in this directory (for ``lost``).
        ``orbax_dir``: where stock Orbax reads (a local copy of an object store's steps).
        """
        from overlap_ckpt.storage import CheckpointStore

        theirs = self.orbax_read(orbax_dir or directory)
        if theirs is None:
            return []
        steps = sorted(theirs["steps"])
        with CheckpointStore(directory, read_only=True) as store:
            ours_steps = store.all_steps()
        if sorted(ours_steps) != steps:
            self.bad("wrong", f"{directory}: overlap_ckpt lists {ours_steps}, stock Orbax {steps}")
        for s in sorted(reported - set(steps)):
            if sum(f > s for f in steps) < worker.KEEP:  # retention keeps the newest KEEP
                self.bad("lost", f"{directory}: step {s} was reported committed and is gone ({steps})")
        self.committed_in.setdefault(str(directory), set()).update(reported, steps)
        for s in steps:
            if s not in self.snaps:
                self.bad("wrong", f"{directory}: step {s} is not a step of the schedule")
                continue
            if self.same_as_reference(s, theirs["restore"][s]):
                self.orbax += 1
            else:
                self.bad("wrong", f"{directory}: stock Orbax restores step {s} with other bits")
            self.verify_ours(directory, s)
        return steps

    def verify_ours(self, directory, step: int, error: type | None = None) -> None:
        """Restore ``step`` with overlap_ckpt: exactly the reference, or (``error``: the step
        was damaged on purpose) exactly that documented class, naming the step."""
        from overlap_ckpt.storage import CheckpointError

        try:
            mine = worker.restore_snapshot(directory, step)
        except CheckpointError as e:
            if error is None:
                self.bad("lost", f"{directory}: step {step} (not damaged) does not restore: {e!r}"[:500])
            elif type(e) is not error or getattr(e, "step", None) != step:
                self.bad("wrong", f"{directory}: damaged step {step} raised {e!r}, documented "
                                  f"{error.__name__} naming the step"[:500])
            else:
                self.ours += 1
            return
        if error is not None:
            self.bad("wrong", f"{directory}: damaged step {step} restored without an error")
        elif self.same_as_reference(step, {path_key(k): v for k, v in mine.items()}):
            self.ours += 1
        else:
            self.bad("wrong", f"{directory}: overlap_ckpt restores step {step} with other bits")

    def check_losses(self, evs, label: str) -> None:
        """Every loss a (resumed) worker printed equals the reference run's, bitwise."""
        diverged = [e["t"] for e in evs if e["ev"] == "step" and e["loss"] != self.ref_losses[e["t"]]]
        if diverged:
            self.bad("wrong", f"{label}: losses differ from the reference at steps {diverged}")

    def resume(self, directory, reported: set[int], label: str) -> None:
        """Resume to the end: it must start at the newest step Orbax lists and go on bitwise."""
        latest = max(self.verify(directory, reported) or [0])
        code, evs, err = self._run_worker(directory, ["--resume"] if latest else [])
        if code != 0:
            self.bad("wrong", f"{label}: resume exited {code}: {err.strip().splitlines()[-1:]}")
            return
        start = [e["step"] for e in evs if e["ev"] == "resumed"] or [0]
        if start[0] != latest:
            self.bad("wrong", f"{label}: resumed from {start[0]}, newest committed is {latest}")
        self.check_losses(evs, label)
        done = [e for e in evs if e["ev"] == "done"]
        if not done or done[0]["errors"]:
            self.bad("wrong", f"{label}: resume reported {done and done[0]['errors']}")
        self.verify(directory, reported | {e["step"] for e in evs if e["ev"] == "commit"})

    @staticmethod
    def commits(evs) -> set[int]:
        return {e["step"] for e in evs if e["ev"] == "commit"}

    # -- faults ----------------------------------------------------------------------------

    def fault_kill(self, d: Path) -> str:
        step = self.rng.choice(SAVE_STEPS)
        if self.rng.random() < 0.8:
            fault = f"kill:{self.rng.choice(STAGES)}:{step}"
        else:  # the window of step 4 is the first: nothing committed to wait for
            fault = f"killsubmit:{self.rng.randrange(worker.WINDOW)}:{max(step, 8)}"
        code, evs, err = self._run_worker(d, env={"FAULT": fault})
        if code == -signal.SIGKILL:
            self.kills += 1
        elif code != 0:
            self.bad("wrong", f"{fault}: worker exited {code}: {err.strip().splitlines()[-1:]}")
        self.check_losses(evs, fault)
        self.resume(d, self.commits(evs), fault)
        return f"kill {fault} (rc {code})"

    def fault_enospc(self, d: Path) -> str:
        # A checkpoint of the worker is ~56 KiB in 14 files: room for one to three of them.
        limit = (f"size={self.rng.randint(16, 40) * 4}k" if self.rng.random() < 0.5
                 else f"nr_inodes={self.rng.randint(18, 40)}")
        mnt, out = d / "mnt", d / "ck"
        mnt.mkdir(parents=True)
        # sh -c SCRIPT mnt out limit worker...: everything written lives in the namespace's
        # tmpfs, so the result is copied out before the namespace (and the tmpfs) goes away.
        script = ('mount -t tmpfs -o "$2" tmpfs "$0" || exit 90; o="$1"; shift 2; "$@"; rc=$?; '
                  'cp -a "$0/ck" "$o"; exit $rc')
        code, evs, err = self._run_worker(mnt / "ck", wrap=["unshare", "-rm", "sh", "-c", script,
                                                            str(mnt), str(out), limit])
        label = f"ENOSPC tmpfs {limit}"
        if code != 0:
            self.bad("wrong", f"{label}: worker exited {code}: {err.strip().splitlines()[-1:]}")
            return label
        errors = [e for e in evs if e["ev"] == "done"][0]["errors"]
        others = [(e["type"], e["errno"]) for e in errors if e["type"] != "OutOfSpaceError"]
        if others:
            self.bad("wrong", f"{label}: failures reported as {others}, documented OutOfSpaceError")
        self.check_losses(evs, label)
        self.verify(out, self.commits(evs))
        return f"{label}: {len(errors)} checkpoints failed"

    def fault_readonly(self, d: Path) -> str:
        stop = min(self.rng.choice(SAVE_STEPS) + self.rng.randrange(worker.INTERVAL), STEPS - 1)
        code, evs, err = self._run_worker(d, steps=stop)
        if code != 0:
            self.bad("wrong", f"run to {stop} exited {code}: {err.strip().splitlines()[-1:]}")
        self.check_losses(evs, f"run to {stop}")
        reported = self.commits(evs)
        before = sorted(os.listdir(d))
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" || exit 90; exec "$@"'
        code, _, err = self._run_worker(d, ["--resume"], wrap=["unshare", "-rm", "sh", "-c", script, str(d)])
        label = f"read-only root after {stop} steps"
        if code == 0 or "CheckpointError" not in err or "Errno 30" not in err:
            self.bad("wrong", f"{label}: exit {code}, not a CheckpointError naming EROFS: "
                              f"{err.strip().splitlines()[-1:]}")
        if sorted(os.listdir(d)) != before:
            self.bad("wrong", f"{label}: the read-only attempt changed {before} to {sorted(os.listdir(d))}")
        self.resume(d, reported, label)
        return label

    def fault_corrupt(self, d: Path) -> str:
        code, evs, err = self._run_worker(d)
        if code != 0:
            self.bad("wrong", f"clean run exited {code}: {err.strip().splitlines()[-1:]}")
            return "corrupt: the clean run failed"
        steps = self.verify(d, self.commits(evs))  # stock Orbax reads every step undamaged
        if not steps:
            return "corrupt: nothing committed"
        step, name = self.rng.choice(steps), self.rng.choice(sorted(DAMAGE))
        damage, error = DAMAGE[name]
        damage(d, step)
        for s in steps:
            self.verify_ours(d, s, error if s == step else None)
        return f"corrupt: {name} on step {step}"

    def s3_server(self):
        """A moto S3 server and the proxy that takes it away, started once, loopback only."""
        if self.s3 is None:
            import boto3
            from moto.server import ThreadedMotoServer

            from tests.storage.s3_proxy import S3Proxy

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
            client.create_bucket(Bucket="soak")
            self.s3 = (server, S3Proxy(host, port), client)
        return self.s3

    def mirror_committed(self, client, prefix: str, dest: Path) -> None:
        """Copy the steps that carry ``commit_success.txt`` (Orbax's commit rule for object
        stores, applied here and not by overlap_ckpt) to a local directory for stock Orbax."""
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
            Bucket="soak", Prefix=prefix) for o in page.get("Contents", [])]
        committed = {k[len(prefix):].split("/")[0] for k in keys if k.endswith("/commit_success.txt")}
        for key in keys:
            rel = key[len(prefix):]
            if rel.split("/")[0] in committed:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file("soak", key, str(dest / rel))

    def fault_s3_down(self, d: Path) -> str:
        from overlap_ckpt.storage import set_fault_hook

        _, proxy, client = self.s3_server()
        step = self.rng.choice(SAVE_STEPS)
        stage = self.rng.choice(("array_write", "data_written", "metadata_written", "before_commit"))
        # Short outages are absorbed by the store's retries; "long" lasts until the next
        # checkpoint starts, i.e. past every retry (~40 s), so that the write fails.
        outage = round(self.rng.uniform(0.1, 5.0), 2) if self.rng.random() < 0.75 else "long"
        spec = {"driver": "s3", "bucket": "soak", "path": f"{d.name}/", "endpoint": proxy.endpoint,
                "aws_region": "us-east-1"}
        timers = []

        def lose_endpoint(st, info):
            if st == stage and info.get("step") == step and not timers:
                proxy.set_mode("down")
                timers.append(threading.Timer(9999 if outage == "long" else outage, proxy.set_mode, ("up",)))
                timers[0].start()
            elif st == "start" and timers and info.get("step", 0) > step:
                timers[0].cancel()
                proxy.set_mode("up")

        previous = set_fault_hook(lose_endpoint)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                result = worker.run(spec, STEPS)
        finally:
            set_fault_hook(previous)
            for t in timers:
                t.cancel()
            proxy.set_mode("up")
        label = f"S3 endpoint down ({outage}) at {stage} of step {step}"
        evs = worker.events(out.getvalue())
        for e in result["errors"]:
            if e["type"] not in ("CheckpointWriteError", "OutOfSpaceError") or f"step {e['step']}" not in e["msg"]:
                self.bad("wrong", f"{label}: failure reported as {e}"[:500])
        self.check_losses(evs, label)
        mirror = d / "orbax-copy"
        mirror.mkdir()
        self.mirror_committed(client, spec["path"], mirror)
        self.verify(spec, self.commits(evs), orbax_dir=mirror)
        return f"{label}: {len(result['errors'])} checkpoints failed"

    # -- loop --------------------------------------------------------------------------------

    @property
    def committed(self) -> int:
        return sum(len(steps) for steps in self.committed_in.values())

    def line(self, minutes: float) -> str:
        return (f"soak: {minutes:.1f} min, kills {self.kills}, faults {dict(sorted(self.faults.items()))}, "
                f"committed {self.committed}, restores verified {self.ours + self.orbax} "
                f"(ours {self.ours} + orbax {self.orbax}), lost {self.lost}, wrong {self.wrong}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="stop starting faults after this long")
    p.add_argument("--iterations", type=int, help="stop after this many faults (CI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    p.add_argument("--each-kind-once", action="store_true",
                   help="cycle through the kinds (in a seeded order) instead of drawing them: CI "
                        "then covers every kind in len(kinds) iterations")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    assert set(kinds) <= set(KINDS), kinds
    os.environ["JAX_PLATFORMS"] = "cpu"
    rng = random.Random(args.seed)
    if args.each_kind_once:
        rng.shuffle(kinds)
    t0 = time.monotonic()

    def log(text: str) -> None:
        if not args.quiet:
            print(f"[{(time.monotonic() - t0) / 60:5.1f} min] {text}", file=sys.stderr, flush=True)

    base = Path(tempfile.mkdtemp(prefix="overlap-soak-"))
    soak = Soak(base, rng, log)
    i = 0
    while time.monotonic() - t0 < args.minutes * 60 and (args.iterations is None or i < args.iterations):
        kind = kinds[i % len(kinds)] if args.each_kind_once else rng.choice(kinds)
        d = base / f"{i:04d}-{kind}"
        d.mkdir()
        found = len(soak.findings)
        try:
            label = getattr(soak, f"fault_{kind}")(d)
        except Exception as e:  # a fault the soak did not foresee is a finding, not a crash
            label = f"{kind}: unexpected {e!r}"[:300]
            soak.bad("wrong", label)
        soak.faults[kind] += 1
        log(f"#{i} {label}; committed {soak.committed}, lost {soak.lost}, wrong {soak.wrong}")
        if len(soak.findings) == found:
            shutil.rmtree(d, ignore_errors=True)
        else:
            log(f"   kept {d} for inspection")
        i += 1
    if soak.s3 is not None:
        soak.s3[1].close()
        soak.s3[0].stop()
    print(soak.line((time.monotonic() - t0) / 60), flush=True)
    if not soak.findings:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if soak.lost or soak.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
