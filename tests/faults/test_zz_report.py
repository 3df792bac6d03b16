"""Prints the table of faults tried (runs last: pytest orders files by name)."""

from . import OUTCOMES


def test_print_fault_table(capsys):
    if not OUTCOMES:
        return
    lines = [f"{'fault':62} {'runs':>4} {'lost':>4} {'wrong':>5}  outcome"]
    for fault, row in OUTCOMES.items():
        lines.append(f"{fault[:62]:62} {row['count']:>4} {row['lost']:>4} {row['wrong']:>5}  {row['outcome']}")
    total = sum(r["count"] for r in OUTCOMES.values())
    lost = sum(r["lost"] for r in OUTCOMES.values())
    wrong = sum(r["wrong"] for r in OUTCOMES.values())
    lines.append(f"{len(OUTCOMES)} faults, {total} runs: committed steps lost = {lost}, wrong states returned = {wrong}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert lost == 0 and wrong == 0
