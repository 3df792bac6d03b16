"""The long run of the layout fuzz test (tests/e2e/test_layouts.py): many drawn layouts,
each checkpointed, killed in a window and resumed three ways, in one command that prints
one summary line (and each failing case as JSON, to replay with ``--case``).

    python tests/e2e/fuzz_layouts.py --examples 50 --seed 1
    python tests/e2e/fuzz_layouts.py --case '<json>' --processes 2 --devices 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from e2e.layouts import Case  # noqa: E402
from e2e.layouts_strategy import cases  # noqa: E402
from e2e.test_layouts import check_layout_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", help="replay one case (JSON, as a failure prints it)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    args = ap.parse_args()
    if args.case:
        with tempfile.TemporaryDirectory() as tmp:
            check_layout_case(Case.from_json(args.case), args.processes, args.devices, Path(tmp))
        print("case passed")
        return 0
    results = {"passed": 0, "failed": 0}
    start = time.monotonic()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(drawn=cases())
    def run(drawn):
        case, nprocs, devices = drawn
        with tempfile.TemporaryDirectory() as tmp:
            try:
                check_layout_case(case, nprocs, devices, Path(tmp))
                results["passed"] += 1
            except AssertionError:
                results["failed"] += 1
                print(f"FAILED --processes {nprocs} --devices {devices} --case '{case.to_json()}'", flush=True)
                traceback.print_exc(limit=1)

    run()
    print(f"layout fuzz: {results['passed']} passed, {results['failed']} failed "
          f"(seed {args.seed}, {time.monotonic() - start:.0f} s)")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
