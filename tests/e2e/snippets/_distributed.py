"""Shared by the multi-host setups: a free TCP port, and the check that a job works."""

import socket
import tempfile

import numpy as np


def free_port(low: int = 1024, high: int = 65535) -> int:
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}]")


def check_store(store) -> None:
    """Save and restore one step through ``store`` (every process of the job calls it)."""
    tree = {"w": np.arange(8, dtype=np.float32)}
    store.save(1, tree)
    store.wait_until_finished()
    back, _ = store.restore(1)
    assert np.asarray(back["w"]).tobytes() == tree["w"].tobytes()


def shared_dir() -> str:
    return tempfile.mkdtemp()
