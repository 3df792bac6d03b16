"""Every ```python block of README.md and docs/*.md runs, each in a fresh interpreter.

Blocks fenced with another language (the README's ```bash quick start, ```json) are not
run. A block that is a fragment of a program (a recipe inside a training loop, one process
of a multi-host job) names its setup with the line ``<!-- snippet: setup NAME -->`` right
before its fence: ``tests/e2e/snippets/NAME.py`` is a program with a ``# <snippet>`` line
where the block goes (at that line's indentation), code before it that builds what the
block uses (and the fault a recipe recovers from), and checks after it that the block did
what the page says. No block is exempt.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from conftest import REPO, run_python

SNIPPETS = os.path.join(REPO, "tests", "e2e", "snippets")
_SETUP = re.compile(r"^<!-- snippet: setup (?P<name>[\w-]+) -->$")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)$")


def python_blocks(path: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, setup name or None)`` of each ```python block of a Markdown file."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, indent, start = m.group("info").strip(), m.group("indent"), i
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^[ \t]*```[ \t]*$", lines[i]):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1  # closing fence
        if info.split()[:1] == ["python"]:
            setup = _SETUP.match(lines[start - 1].strip()) if start > 0 else None
            blocks.append((start + 1, "\n".join(body) + "\n", setup and setup["name"]))
    return blocks


def _pages() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _cases():
    for page in _pages():
        rel = os.path.relpath(page, REPO)
        for line, code, setup in python_blocks(page):
            yield pytest.param(rel, line, code, setup, id=f"{rel}:{line}")


CASES = list(_cases())


def test_the_pages_have_snippets():
    pages = {c.values[0] for c in CASES}
    for page in ["README.md", "docs/linen.md", "docs/nnx.md", "docs/manager.md", "docs/orbax.md",
                 "docs/functional.md"]:
        assert page in pages, f"{page} has no ```python block"


def test_readme_keeps_its_bash_quick_start_first():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    first = text.index("```")
    assert text[first:].startswith('```bash\npip install -e ".[test]" && overlap-ckpt demo\n'
                                   'python -m pytest -q\n```')


def with_setup(code: str, setup: str) -> str:
    """The program of ``tests/e2e/snippets/<setup>.py`` with ``code`` at its ``# <snippet>`` line."""
    lines = open(os.path.join(SNIPPETS, f"{setup}.py"), encoding="utf-8").read().splitlines()
    at = [i for i, line in enumerate(lines) if line.strip() == "# <snippet>"]
    assert len(at) == 1, f"{setup}.py needs exactly one '# <snippet>' line"
    indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    block = [indent + line if line.strip() else line for line in code.splitlines()]
    return "\n".join(lines[: at[0]] + block + lines[at[0] + 1:]) + "\n"


@pytest.mark.parametrize("page,line,code,setup", CASES)
def test_snippet_runs(page, line, code, setup, tmp_path):
    if setup is not None:  # run as a file (a multi-process setup starts itself again)
        program = tmp_path / f"{setup}.py"
        program.write_text(with_setup(code, setup))
        code = (f"import os, runpy, sys\nsys.path.insert(0, {SNIPPETS!r})\n"
                f"os.environ['PYTHONPATH'] = {SNIPPETS!r} + os.pathsep + os.environ['PYTHONPATH']\n"
                f"runpy.run_path({str(program)!r}, run_name='__main__')\n")
    # docs/aot.md's examples compile for its reports, which read the compiler's dumps: a
    # program the run's compilation cache answers writes none (the page says so).
    result = run_python(code, timeout=300, compile_cache=page != "docs/aot.md")
    assert result.returncode == 0, (
        f"{page}:{line} exited with {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-6000:]}")
