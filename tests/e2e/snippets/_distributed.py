"""Shared by the multi-host setups: a free TCP port, and the check that a job works."""

import random
import socket
import tempfile

import numpy as np


def free_port(low: int | None = None, high: int = 65535) -> int:
    """A port free on loopback now: one the OS assigns, or, where the port must lie in a
    range (SLURM's is derived from the job id), one in ``[low, high]`` tried from a random
    place, so that jobs started at the same moment do not all pick the range's first."""
    if low is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    ports = list(range(low, high + 1))
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
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
