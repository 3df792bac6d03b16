"""Restore onto 1, 2 and 4 simulated CPU devices with shardings different from the save.

Runs in a subprocess because ``--xla_force_host_platform_device_count`` must be set before
jax is imported (the test process may already have imported it with one device).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import REPO


SCRIPT = textwrap.dedent(r"""
    import sys
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
    from overlap_ckpt.storage import CheckpointStore
    from overlap_ckpt.storage import restore as restore_mod

    devices = jax.devices()
    assert len(devices) == 4, devices
    root = sys.argv[1]

    def mesh(n, shape, names):
        return Mesh(np.asarray(devices[:n]).reshape(shape), names)

    full_w = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) / 7
    full_v = np.arange(16, dtype=np.int32)
    full_s = np.float32(3.5)
    m22 = mesh(4, (2, 2), ("x", "y"))
    # Saved from 4 devices: w sharded 2x2, v sharded 4 ways over a flattened mesh, s replicated.
    saved = {
        "w": jax.device_put(full_w, NamedSharding(m22, P("x", "y"))),
        "v": jax.device_put(full_v, NamedSharding(mesh(4, (4,), ("d",)), P("d"))),
        "s": jax.device_put(full_s, NamedSharding(m22, P())),
    }
    with CheckpointStore(root + "/a", chunk_bytes=64) as store:
        store.save(1, saved)
        store.wait_until_finished()

        def check(target, label):
            # Both read strategies: whole array then slice (single process), and one read per
            # distinct device domain (what a multi-process restore does).
            for whole in (True, False):
                restore_mod.WHOLE_READ_WHEN_ADDRESSABLE = whole
                out, _ = store.restore(1, target)
                for k, full in (("w", full_w), ("v", full_v), ("s", full_s)):
                    got = out[k]
                    assert got.sharding == target[k].sharding, (label, k, got.sharding)
                    assert np.asarray(got).tobytes() == np.asarray(full).tobytes(), (label, k)
                    for shard in got.addressable_shards:  # each device holds exactly its block
                        assert np.asarray(shard.data).tobytes() == np.asarray(full)[shard.index].tobytes()
            restore_mod.WHOLE_READ_WHEN_ADDRESSABLE = True
            print("ok", label)

        def target(shardings):
            return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=shardings[k])
                    for k, v in (("w", full_w), ("v", full_v), ("s", full_s))}

        one = SingleDeviceSharding(devices[3])
        check(target({"w": one, "v": one, "s": one}), "1 device")
        m2 = mesh(2, (2,), ("d",))
        check(target({"w": NamedSharding(m2, P(None, "d")), "v": NamedSharding(m2, P()),
                      "s": NamedSharding(m2, P())}), "2 devices, column-sharded / replicated")
        m4 = mesh(4, (4,), ("d",))
        check(target({"w": NamedSharding(m4, P("d", None)), "v": NamedSharding(mesh(4, (2, 2), ("a", "b")), P(("b", "a"))),
                      "s": NamedSharding(m4, P())}), "4 devices, row-sharded / permuted")
        check(target({"w": NamedSharding(mesh(4, (2, 2), ("a", "b")), P("b", "a")),
                      "v": NamedSharding(m4, P("d")), "s": NamedSharding(m4, P())}), "4 devices, transposed mesh")
        # A concrete jax array as the target leaf: its sharding is reused.
        conc = {"w": jax.device_put(np.zeros_like(full_w), NamedSharding(m4, P(None, "d"))),
                "v": jnp.zeros(16, jnp.int32), "s": jnp.float32(0)}
        out, _ = store.restore(1, conc)
        assert out["w"].sharding == conc["w"].sharding
        assert np.asarray(out["w"]).tobytes() == full_w.tobytes()
        print("ok concrete")

    # Saved from a single device, restored onto 4.
    with CheckpointStore(root + "/b") as store:
        store.save(2, {"w": full_w, "v": full_v, "s": full_s})
        store.wait_until_finished()
        m = mesh(4, (2, 2), ("x", "y"))
        tgt = {"w": jax.ShapeDtypeStruct((8, 12), np.float32, sharding=NamedSharding(m, P("y", "x"))),
               "v": jax.ShapeDtypeStruct((16,), np.int32, sharding=NamedSharding(m, P(("x", "y")))),
               "s": jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(m, P()))}
        out, _ = store.restore(2, tgt)
        assert np.asarray(out["w"]).tobytes() == full_w.tobytes()
        assert np.asarray(out["v"]).tobytes() == full_v.tobytes()
        print("ok 1->4")
    print("ALL OK")
""")


def test_restore_onto_other_meshes(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr
