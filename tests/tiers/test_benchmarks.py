"""The local tier's benchmark scripts run, and the goodput model behaves as its formula says."""

from __future__ import annotations

import pytest

from benchmarks import bench_replicas, bench_tiers, goodput_model

A = goodput_model.Assumptions


def test_goodput_model_credits_the_local_tier_only_for_failures_a_host_survives():
    mtbf = 13 * 60.0
    gains = []
    for share in (0.0, 0.2, 0.5, 1.0):
        out = goodput_model.predict(A(host_survives=share), mtbf)
        gains.append(out["overlap_ckpt + local tier"][0] - out["overlap_ckpt durable-only"][0])
    assert gains[0] == pytest.approx(0.0, abs=1e-9)
    assert gains == sorted(gains) and gains[-1] > 0.01
    # Rarer failures: checkpointing matters less, every configuration gains.
    rare = goodput_model.predict(A(), 3 * 3600.0)
    assert all(rare[k][0] > g for k, (g, _) in goodput_model.predict(A(), mtbf).items())


def test_bench_tiers_smoke(tmp_path):
    report = bench_tiers.main(["--gib", "0.005", "--layers", "2", "--repeats", "1", "--dir", str(tmp_path)])
    assert set(report["restore"]) == {"local", "durable_warm", "durable_cold"}
    assert set(report["persist"]) == {"local", "durable"}
    assert all(v["median_s"] > 0 for v in report["restore"].values())


def test_bench_replicas_smoke():
    report = bench_replicas.main(["--mib", "1", "--rounds", "1", "--processes", "2", "--timeout", "50"])
    assert set(report["mb_per_s"]) == {"pair/bulk", "pair/kv", "ring/bulk", "ring/kv", "memcpy/memcpy"}
    assert all(v["median"] > 0 for v in report["mb_per_s"].values())
    # The key-value path relays each message through the store (set and read: twice its
    # bytes); the bulk path puts only heads and acknowledgements there.
    assert report["kv_store_bytes_per_phase"]["pair/kv"]["median"] >= 2 << 20
    assert report["kv_store_bytes_per_phase"]["pair/bulk"]["median"] < 4096
