"""``overlap-ckpt aot`` end to end on the CPU target (no plugin needed), and its refusals."""

import os
import subprocess
import sys


def aot(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "overlap_ckpt.tools.cli", "aot", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_cpu_report(tmp_path):
    # With JAX's persistent compilation cache set, as many users have it: the user step is the
    # plain step's program, which the cache would answer without a compile (nothing dumped).
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    out = tmp_path / "report.md"
    r = aot("--target", "cpu", "--model", "tiny", "--k", "1", "--output", str(out), env={**os.environ, **cache})
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert text == r.stdout.rstrip("\n") + "\n"
    assert "| plain step |" in text and "| phase 0 of 1 |" in text
    assert "**yes**" in text  # the plain step is the user's program
    assert "Orbax async" in text and "overlap K=1 (given)" in text


def test_unknown_target_is_one_line_naming_the_choices():
    r = aot("--target", "v9z:2x2")
    assert r.returncode == 1 and "unknown target 'v9z:2x2'" in r.stderr and "Traceback" not in r.stderr


def test_measure_needs_a_target_whose_devices_are_here():
    r = aot("--target", "v5e:2x2", "--measure")
    assert r.returncode == 1 and "--measure" in r.stderr and "Traceback" not in r.stderr


def test_the_gpu_target_without_a_gpu_is_one_line_naming_the_compile_only_target():
    r = aot("--target", "gpu", "--measure", env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 1 and "JAX sees none" in r.stderr and "--target h100" in r.stderr
    assert "Traceback" not in r.stderr


def test_profile_needs_the_gpu_measurement():
    r = aot("--target", "cpu", "--profile", "/tmp/x")
    assert r.returncode == 1 and "--target gpu --measure" in r.stderr and "Traceback" not in r.stderr


def test_repeated_k_options_add_up():
    """``--k 1 --k 2`` compiles both (argparse's default keeps only the last ``--k``)."""
    from overlap_ckpt.tools.cli import build_parser

    assert build_parser().parse_args(["aot", "--target", "cpu", "--k", "1", "--k", "2", "3"]).k == [1, 2, 3]
    assert build_parser().parse_args(["aot", "--target", "cpu"]).k is None
