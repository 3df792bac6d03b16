"""An object store that goes away in the middle of a write, and one that throttles.

The store talks to the local S3 server through :class:`S3Proxy`, which a fault hook
switches off between two requests of a persist. Checked: the failed checkpoint is reported
(a ``CheckpointWriteError`` naming the step and the endpoint), readers never see a partial
step, the next checkpoint commits once the endpoint is back, earlier steps are intact, and
throttling (503 SlowDown) is retried a bounded number of times.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from overlap_ckpt.storage import CheckpointStore, CheckpointWriteError, set_fault_hook

from .s3_proxy import S3Proxy
from .test_s3 import s3_spec  # noqa: F401 - the moto server fixture

RETRIES = 2  # max_request_retries
# Attempts of one request: TensorStore's RETRIES + 1, each of which curl may repeat once when
# the server closed a reused connection without a reply (an endpoint going away does).
MAX_ATTEMPTS = 2 * (RETRIES + 1)


@pytest.fixture
def proxied(s3_spec, request):  # noqa: F811 - the fixture imported above
    port = int(s3_spec["endpoint"].rsplit(":", 1)[1])
    proxy = S3Proxy("127.0.0.1", port)
    yield proxy, dict(s3_spec, endpoint=proxy.endpoint, path=f"{request.node.name}/")
    proxy.close()


def tree(step: int) -> dict:
    return {"w": np.arange(3000, dtype=np.float32) + step, "n": np.int32(step)}


def assert_restores(store: CheckpointStore, steps: list[int]) -> None:
    assert store.all_steps() == steps and store.verify().ok
    for step in steps:
        back, _ = store.restore(step)
        assert back["w"].tobytes() == tree(step)["w"].tobytes() and int(back["n"]) == step


def test_endpoint_lost_mid_write_then_back(proxied):
    proxy, spec = proxied

    def lose_endpoint(stage, info):  # after the first array, before the others and the marker
        if stage == "array_write" and info["step"] == 2 and info["array"] == "w":
            proxy.set_mode("down")

    with CheckpointStore(spec, max_request_retries=RETRIES) as store:
        store.save(1, tree(1))
        store.wait_until_finished()
        previous = set_fault_hook(lose_endpoint)
        try:
            store.save(2, tree(2))
            with pytest.raises(CheckpointWriteError) as info:
                store.wait_until_finished()
        finally:
            set_fault_hook(previous)
        assert info.value.step == 2 and "step 2" in str(info.value), info.value
        assert proxy.endpoint in str(info.value), info.value  # names where it failed
        assert "next save removes it" in str(info.value), info.value  # the endpoint was down
        assert proxy.attempts and max(proxy.attempts.values()) <= MAX_ATTEMPTS, proxy.attempts
        proxy.set_mode("up")  # the endpoint is back
        with CheckpointStore(spec, read_only=True) as reader:
            assert reader.all_steps() == [1]  # no partial step 2 visible
        store.save(3, tree(3))
        store.wait_until_finished()
        assert store.incomplete_steps() == []  # the leftovers of 2 were removed after 3 committed
        assert_restores(store, [1, 3])


def test_throttling_is_retried_and_bounded(proxied, caplog):
    proxy, spec = proxied
    with CheckpointStore(spec, max_request_retries=RETRIES) as store:
        proxy.set_mode("slowdown", budget=RETRIES)  # fewer 503s than retries: absorbed
        store.save(1, tree(1))
        store.wait_until_finished()
        assert proxy.budget == 0  # the 503s were answered, and retried
        proxy.set_mode("slowdown", budget=10**9)  # throttled for good
        with caplog.at_level(logging.ERROR, logger="overlap_ckpt"):
            store.save(2, tree(2))
            with pytest.raises(CheckpointWriteError, match="step 2") as info:
                store.wait_until_finished()
        assert proxy.endpoint in str(info.value) and "503" in str(info.value), info.value
        assert RETRIES < max(proxy.attempts.values()) <= MAX_ATTEMPTS, proxy.attempts  # bounded
        assert "step 2" in caplog.text and "retry attempts failed" in caplog.text
        proxy.set_mode("up")
        store.save(3, tree(3))
        store.wait_until_finished()
        assert_restores(store, [1, 3])
