"""Where a benchmark's report goes: ``<out>.json`` (every figure, for later analysis) and
``<out>.md`` (the table committed under ``benchmarks/results/``), and the table to stdout."""

from __future__ import annotations

import json


def publish(report: dict, markdown: str, out: str | None) -> None:
    print(markdown)
    if out:
        with open(out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(markdown)
