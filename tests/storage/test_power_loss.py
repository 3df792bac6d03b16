"""Power loss: the commit's fsync-then-rename order, read from the system calls of a real save.

Why syscalls: every crash test kills with SIGKILL, which keeps the page cache, so a save
that renames ``<step>.orbax-checkpoint-tmp`` to ``<step>`` before its files and directory
entries reach the disk passes them all, and after a power cut leaves a step that looks
committed but is empty or torn. ``strace`` records, for one ``CheckpointStore.save`` (our
writes and TensorStore's alike), every write, fsync and rename with the path of each
file descriptor. The property checked (storage/commit.py's docstring):

1. every file of the committed step was fsync'd after its last write and before the rename
   (a file written as a temporary and renamed into place counts with its fsync);
2. every directory of the step was fsync'd after its last entry changed, before the rename;
3. the root directory was fsync'd after the rename (the rename itself is durable).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

SAVE = textwrap.dedent("""
    import sys
    import numpy as np
    from overlap_ckpt.storage import CheckpointStore

    with CheckpointStore(sys.argv[1]) as store:  # two arrays, one larger than an inline value
        store.save(7, {"w": np.arange(4096, dtype=np.float32).reshape(64, 64),
                       "b": np.ones(3, np.int32)})
        store.wait_until_finished()
""")

SYSCALLS = ("openat,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,rename,renameat,"
            "renameat2,mkdir,mkdirat,unlink,unlinkat")
_CALL = re.compile(r"^(?P<pid>\d+)\s+(?P<name>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)")
_FD = re.compile(r"^(-?\d+|AT_FDCWD)<(?P<path>[^>]*)>")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')
_WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2"}


def _calls(trace: str):
    """``(index, name, args, ret)`` of each completed call, in completion order; unfinished
    calls are joined with their ``resumed`` line."""
    pending, out = {}, []
    for line in trace.splitlines():
        m = re.match(r"^(\d+)\s+(.*)$", line)
        if not m:
            continue
        pid, rest = m.groups()
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"^<\.\.\. \w+ resumed>\s?(.*)$", rest)
        if resumed:
            rest = pending.pop(pid, "") + resumed.group(1)
        call = _CALL.match(f"{pid} {rest}")
        if call and int(call["ret"]) >= 0:
            out.append((len(out), call["name"], call["args"], int(call["ret"])))
    return out


def _path_args(args: str) -> list[str]:
    """Absolute paths named by the arguments: ``fd</path>`` annotations, and strings joined
    to the directory fd before them (``openat(5</d>, "name")``)."""
    paths, dir_fd = [], None
    for part in _split_args(args):
        fd = _FD.match(part)
        if fd:
            dir_fd = fd["path"]
            if not part.startswith("AT_FDCWD"):
                paths.append(fd["path"])
            continue
        s = _STR.match(part)
        if s:
            name = s.group(1)
            paths.append(name if name.startswith("/") else os.path.join(dir_fd or "/", name))
    return paths


def _split_args(args: str) -> list[str]:
    parts, depth, quoted, cur = [], 0, False, ""
    for i, ch in enumerate(args):
        if ch == '"' and (i == 0 or args[i - 1] != "\\"):
            quoted = not quoted
        if not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


def check_commit_order(trace: str, root: str, step: int) -> list[str]:
    """Violations of the three rules of the module docstring (empty: the order is right)."""
    tmp, final = f"{root}/{step}.orbax-checkpoint-tmp", f"{root}/{step}"
    modified, synced, entries = {}, {}, collections.defaultdict(int)
    commit_at = None
    root_synced_after = False
    for i, name, args, ret in _calls(trace):
        paths = _path_args(args)
        if name in ("rename", "renameat", "renameat2") and paths[-2:] == [tmp, final]:
            commit_at = i
            continue
        if commit_at is not None:
            root_synced_after |= name in ("fsync", "fdatasync") and paths == [root]
            continue
        if name in _WRITES:
            modified[paths[0]] = i
        elif name in ("fsync", "fdatasync"):
            synced[paths[0]] = i
        elif name in ("openat", "creat") and ("O_CREAT" in args or name == "creat"):
            modified.setdefault(paths[0], i)
            entries[os.path.dirname(paths[0])] = i
        elif name in ("rename", "renameat", "renameat2"):
            src, dst = paths[-2:]
            for table in (modified, synced):  # the file keeps its state under its new name
                if src in table:
                    table[dst] = table.pop(src)
            entries[os.path.dirname(src)] = entries[os.path.dirname(dst)] = i
        elif name in ("mkdir", "mkdirat", "unlink", "unlinkat"):
            entries[os.path.dirname(paths[-1])] = i
    if commit_at is None:
        return [f"no rename of {tmp} to {final} in the trace"]
    problems = []
    for dirpath, _dirs, files in os.walk(final):
        d = tmp + dirpath[len(final):]
        if not entries.get(d, -1) < synced.get(d, -1):
            problems.append(f"directory {d} not fsync'd after its last entry change")
        for f in files:
            p = f"{d}/{f}"
            if not modified.get(p, -1) < synced.get(p, -1):
                problems.append(f"file {p} not fsync'd after its last write")
    if not root_synced_after:
        problems.append(f"root {root} not fsync'd after the commit rename")
    return problems


def test_commit_fsyncs_everything_before_the_rename_and_the_root_after(tmp_path):
    assert shutil.which("strace"), "strace is needed to read the commit's system calls"
    root, log = str(tmp_path / "ck"), str(tmp_path / "trace.txt")
    proc = subprocess.run(["strace", "-f", "-y", "-qq", "-s", "256", "-o", log, "-e", f"trace={SYSCALLS}",
                           sys.executable, "-c", SAVE, root],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = open(log).read()
    assert check_commit_order(trace, root, 7) == []


@pytest.mark.parametrize("lines,problem", [
    # rename before the directory fsync: the entry may be lost with the power
    (['1 openat(AT_FDCWD</>, "@/7.orbax-checkpoint-tmp/f", O_WRONLY|O_CREAT, 0644) = 3<@/7.orbax-checkpoint-tmp/f>',
      '1 write(3<@/7.orbax-checkpoint-tmp/f>, "x", 1) = 1',
      '1 fsync(3<@/7.orbax-checkpoint-tmp/f>) = 0',
      '1 rename("@/7.orbax-checkpoint-tmp", "@/7") = 0',
      '1 fsync(4<@/7>) = 0', '1 fsync(5<@>) = 0'], "directory @/7.orbax-checkpoint-tmp not fsync'd"),
    # a write after the file's fsync
    (['1 openat(AT_FDCWD</>, "@/7.orbax-checkpoint-tmp/f", O_WRONLY|O_CREAT, 0644) = 3<@/7.orbax-checkpoint-tmp/f>',
      '1 fsync(3<@/7.orbax-checkpoint-tmp/f>) = 0',
      '1 write(3<@/7.orbax-checkpoint-tmp/f>, "x", 1) = 1',
      '1 fsync(4<@/7.orbax-checkpoint-tmp>) = 0',
      '1 rename("@/7.orbax-checkpoint-tmp", "@/7") = 0', '1 fsync(5<@>) = 0'], "file @/7.orbax-checkpoint-tmp/f"),
])
def test_the_checker_sees_a_wrong_order(tmp_path, lines, problem):
    """The checker itself, on hand-written traces of wrong orders (``@``: the root)."""
    root = str(tmp_path / "ck")
    os.makedirs(f"{root}/7")
    open(f"{root}/7/f", "w").close()
    problems = check_commit_order("\n".join(lines).replace("@", root), root, 7)
    assert any(problem.replace("@", root) in p for p in problems), problems
