"""Prints the table of faults tried at the end of the run (each fault's test asserts its own
outcome; this is the report). The outcomes are gathered in the process that ran the tests,
so the table needs a run in one process: ``pytest tests/faults -n 0``."""

from . import OUTCOMES


def pytest_terminal_summary(terminalreporter):
    if not OUTCOMES:
        return
    lines = [f"{'fault':62} {'runs':>4} {'lost':>4} {'wrong':>5}  outcome"]
    for fault, row in OUTCOMES.items():
        lines.append(f"{fault[:62]:62} {row['count']:>4} {row['lost']:>4} {row['wrong']:>5}  {row['outcome']}")
    total = sum(r["count"] for r in OUTCOMES.values())
    lost = sum(r["lost"] for r in OUTCOMES.values())
    wrong = sum(r["wrong"] for r in OUTCOMES.values())
    lines.append(f"{len(OUTCOMES)} faults, {total} runs: committed steps lost = {lost}, "
                 f"wrong states returned = {wrong}")
    terminalreporter.write_sep("-", "fault-injection report")
    terminalreporter.write_line("\n".join(lines))
