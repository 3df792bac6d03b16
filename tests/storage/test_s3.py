"""The object-store protocol (commit marker, no rename) against a local S3 server (moto)."""

from __future__ import annotations

import numpy as np
import pytest

from overlap_ckpt.storage import CheckpointStore, CheckpointWriteError, set_fault_hook

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def s3_spec():
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt-test")
    yield {"driver": "s3", "bucket": "ckpt-test", "path": "run1/", "endpoint": endpoint,
           "aws_region": "us-east-1"}
    server.stop()
    mp.undo()


def test_s3_round_trip_and_commit_marker(s3_spec):
    tree = {"w": np.arange(600, dtype=np.float32).reshape(20, 30), "n": np.int32(4)}
    with CheckpointStore(s3_spec, max_to_keep=1, chunk_bytes=512) as store:
        store.save(1, tree, {"k": "v"})
        store.wait_until_finished()

        def fail(stage, info):
            if stage == "before_commit":
                raise OSError(5, "Input/output error")

        previous = set_fault_hook(fail)
        try:
            store.save(2, tree)
            with pytest.raises(CheckpointWriteError):
                store.wait_until_finished()
        finally:
            set_fault_hook(previous)
        # Everything but the marker was uploaded; without the marker the step is invisible.
        assert store.all_steps() == [1] and store.incomplete_steps() == []
        store.save(3, {"w": tree["w"] + 1, "n": np.int32(5)})
        store.wait_until_finished()
        assert store.all_steps() == [3]  # retention deleted step 1 after the commit of 3
        back, meta = store.restore()
        assert back["w"].tobytes() == (tree["w"] + 1).tobytes() and int(back["n"]) == 5
        assert store.verify().ok


def test_s3_bad_bucket_fails_at_open_with_a_clear_error(s3_spec):
    from overlap_ckpt.storage import CheckpointError
    with pytest.raises(CheckpointError, match="Cannot open checkpoint storage .*credentials"):
        CheckpointStore(dict(s3_spec, bucket="no-such-bucket"), max_request_retries=1)


def test_s3_endpoint_lost_mid_training_fails_the_persist_not_training(s3_spec):
    """The endpoint becomes unreachable after the store opened: save() still returns at
    once (while the persist is held at its first stage), the persist fails after a few
    bounded retries, the error surfaces from wait_until_finished (and would from the next
    save), and earlier steps are untouched."""
    import socket
    import threading

    tree = {"w": np.arange(64, dtype=np.float32)}
    spec = dict(s3_spec, path="lost/")
    with CheckpointStore(spec, max_request_retries=2) as store:
        store.save(1, tree)
        store.wait_until_finished()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    from overlap_ckpt.storage.location import open_location
    # Opened while reachable (read_only: no lock to release later); then the endpoint is lost.
    store = CheckpointStore(spec, max_request_retries=2, read_only=True)
    store.read_only = False
    store.location = open_location(dict(spec, endpoint=dead), store._context)
    gate, released = threading.Event(), threading.Event()

    def hold(stage, info):
        if stage == "start":
            gate.wait(30)
            released.set()

    previous = set_fault_hook(hold)
    try:
        store.save(2, tree)
        assert not released.is_set()  # training is not blocked: save returned, persist held
        gate.set()
        with pytest.raises(CheckpointWriteError, match="step 2 .*(connect|Could not)"):
            store.wait_until_finished()
    finally:
        gate.set()
        set_fault_hook(previous)
    store.close()
    with CheckpointStore(spec, read_only=True) as again:
        assert again.all_steps() == [1]
