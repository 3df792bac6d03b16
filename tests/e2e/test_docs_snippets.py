"""Every ```python block of README.md and docs/*.md runs, each in a fresh interpreter.

Blocks fenced with another language (the README's ```bash quick start, ```json) are not
run. A block that is a reference fragment rather than a program can opt out with the
line ``<!-- snippet: skip -->`` right before its fence.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from conftest import REPO, run_python

SKIP_MARKER = "<!-- snippet: skip -->"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)$")


def python_blocks(path: str) -> list[tuple[int, str, bool]]:
    """``(line, code, marked_skip)`` of each ```python block of a Markdown file."""
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
            marked = start > 0 and lines[start - 1].strip() == SKIP_MARKER
            blocks.append((start + 1, "\n".join(body) + "\n", marked))
    return blocks


def _pages() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _cases():
    for page in _pages():
        rel = os.path.relpath(page, REPO)
        for line, code, marked in python_blocks(page):
            yield pytest.param(rel, line, code, marked, id=f"{rel}:{line}")


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


@pytest.mark.parametrize("page,line,code,marked", CASES)
def test_snippet_runs(page, line, code, marked):
    if marked:
        pytest.skip(f"{page}:{line} is marked {SKIP_MARKER}")
    result = run_python(code, timeout=300)
    assert result.returncode == 0, (
        f"{page}:{line} exited with {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-6000:]}")
