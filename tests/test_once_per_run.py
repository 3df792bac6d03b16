"""The suite's ``once_per_run`` (tests/conftest.py): a fixture shared by the xdist workers is
built by one of them, the others get its result, and a failed build is not recorded."""

import multiprocessing
import time

import pytest

from conftest import once_per_run


class Factory:
    """Stands in for pytest's ``tmp_path_factory``: each process's base directory lies in a
    run-wide one, as xdist's workers' do."""

    def __init__(self, run_dir, worker):
        self.base = run_dir / f"popen-{worker}"

    def getbasetemp(self):
        return self.base


def build_slowly(directory):
    with open(directory.parent / "builds.log", "a") as log:
        log.write("built\n")
    time.sleep(0.5)  # long enough for the other process to ask meanwhile
    (directory / "data").write_text("payload")
    return {"path": directory / "data"}


def ask(run_dir, worker, out):
    result = once_per_run(Factory(run_dir, worker), "shared", build_slowly)
    out.put((worker, str(result["path"]), result["path"].read_text()))


def test_two_workers_asking_at_once_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    ctx = multiprocessing.get_context("spawn")  # not fork: this process runs JAX's threads
    out = ctx.Queue()
    procs = [ctx.Process(target=ask, args=(tmp_path, worker, out)) for worker in ("gw0", "gw1")]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert [r[1:] for r in results] == [(str(tmp_path / "once-shared" / "data"), "payload")] * 2


def test_a_failed_build_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    factory = Factory(tmp_path, "gw0")
    calls = []

    def failing(directory):
        calls.append("failing")
        (directory / "partial").write_text("x")
        raise AssertionError("the build's own check failed")

    with pytest.raises(AssertionError, match="own check"):
        once_per_run(factory, "flaky", failing)

    def good(directory):
        calls.append("good")
        return sorted(p.name for p in directory.iterdir())  # the failed build's files are gone

    assert once_per_run(factory, "flaky", good) == []
    assert once_per_run(factory, "flaky", good) == []
    assert calls == ["failing", "good"]
