"""``benchmarks/results/`` holds what the repository cites, and its INDEX.md lists it.

Why: the folder had grown to 184 files, about 45 of them cited; a reader could not tell the
current report from an intermediate run, and a doc cited an old matrix as current (issue 57).
Earlier and intermediate runs now live in ``results/archive/``, and these rules keep the rest
honest (no JAX, no benchmark run: text only):

(a) every result that a doc, a README, a benchmark script, a test or the package cites exists
    in ``results/`` (in ``archive/`` only where the citation says ``archive/``);
(b) every file directly in ``results/`` but INDEX.md is cited by one of those, or is a ``.json``
    or ``.png`` that a report so cited names (its data, its plot), or is the ``.json`` beside a
    report so cited (``reporting.publish`` writes the two together);
(c) INDEX.md lists every such file and nothing else, and each file it says cites one does;
(d) a kept report's names of other results resolve, and its Markdown links stay in ``results/``;
(e) a kept report names, near its top, the commit of the code it measured (``benchmarks/reporting.py``
    writes it; a report whose run did not record it names the commit that last wrote it).

A citation is ``results/NAME`` (``benchmarks/results/NAME``, ``results/archive/NAME``) or a bare
file name of the results' families (``gpu_h200_100m.md``), ending in .md, .json or .png;
``{a,b}`` alternatives and ``*`` expand against the files, a name that starts with ``*`` cites
nothing, and an output path on a command line (``--out``, ``--json``) cites only in a report
(where it names the report's own data), not in a usage line.
"""

import fnmatch
import functools
import os
import re
import subprocess

from conftest import REPO

RESULTS = os.path.join(REPO, "benchmarks", "results")
ARCHIVE = os.path.join(RESULTS, "archive")
INDEX = "INDEX.md"
CITING_ROOTS = ("README.md", "docs", "benchmarks", "overlap_ckpt", "tests", "examples")
NAME = r"(?:[\w*-]|\{[\w,-]*\})+\.(?:md|json|png)(?![\w.])"
PATH_RE = re.compile(r"\bresults/((?:archive/)?" + NAME + ")")
BARE_RE = re.compile(r"(?<![\w/.{},*-])(" + NAME + ")")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
OUTPUT_RE = re.compile(r"--(?:out|json|output)[ =]\S+")


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [name for alt in match.group(1).split(",")
            for name in _expand(pattern[:match.start()] + alt + pattern[match.end():])]


@functools.lru_cache(maxsize=None)
def _files() -> tuple[frozenset, frozenset]:
    kept = frozenset(f for f in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, f)) and f != INDEX)
    archived = frozenset(os.listdir(ARCHIVE)) if os.path.isdir(ARCHIVE) else frozenset()
    return kept, archived


def _families() -> set[str]:
    kept, archived = _files()
    return {name.split("_")[0] for name in kept | archived if "_" in name}


def citations(text: str, outputs: bool = False) -> set[str]:
    """The result names ``text`` cites, as written (patterns unexpanded but for ``{a,b}``);
    with ``outputs``, command lines' output paths too (a report naming where its data went)."""
    if not outputs:
        text = OUTPUT_RE.sub(" ", text)
    found = set()
    for m in PATH_RE.finditer(text):
        found.update(_expand(m.group(1)))
    families = _families()
    for m in BARE_RE.finditer(text):
        if "_" in m.group(1) and m.group(1).split("_")[0] in families:
            found.update(_expand(m.group(1)))
    return {c for c in found if not c.split("/")[-1].startswith("*")}


def _resolve(cited: str, names) -> set[str]:
    return {name for name in names if fnmatch.fnmatchcase(name, cited)}


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def citing_files() -> dict[str, set[str]]:
    """Repository path -> what it cites, for every doc, README, script, test and module
    outside ``benchmarks/results`` (this test's own text aside)."""
    out = {}
    for root in CITING_ROOTS:
        top = os.path.join(REPO, root)
        if os.path.isfile(top):
            paths = [top]
        else:
            paths = []
            for d, dirs, files in os.walk(top):
                dirs[:] = [x for x in dirs if x != "__pycache__" and os.path.join(d, x) != RESULTS]
                paths += [os.path.join(d, f) for f in files if f.endswith((".md", ".py", ".sh"))]
        for path in paths:
            if os.path.abspath(path) == os.path.abspath(__file__):
                continue
            cited = citations(_read(path))
            if cited:
                out[os.path.relpath(path, REPO)] = cited
    return out


@functools.lru_cache(maxsize=None)
def cited_by_docs() -> dict[str, set[str]]:
    """Kept result -> the repository files that cite it."""
    kept, _ = _files()
    out: dict[str, set[str]] = {}
    for path, cited in citing_files().items():
        for c in cited:
            for name in _resolve(c, kept):
                out.setdefault(name, set()).add(path)
    return out


@functools.lru_cache(maxsize=None)
def _named_by(report: str) -> frozenset:
    """The kept results that kept report ``report`` names."""
    kept, _ = _files()
    cited = citations(_read(os.path.join(RESULTS, report)), outputs=True)
    return frozenset(name for c in cited for name in _resolve(c, kept))


def _cites(report: str, name: str) -> bool:
    return name in _named_by(report)


def why_kept(name: str) -> str | None:
    """Why ``name`` may stay in ``results/`` (rule (b)), or None."""
    docs = cited_by_docs()
    if name in docs:
        return "cited by " + ", ".join(sorted(docs[name]))
    if name.endswith((".json", ".png")):
        for report in sorted(r for r in docs if r.endswith(".md")):
            if _cites(report, name):
                return f"named by {report}"
        if name.endswith(".json") and name[:-len(".json")] + ".md" in docs:
            return f"the data of {name[:-len('.json')]}.md"
    return None


def test_cited_results_exist():
    kept, archived = _files()
    missing = []
    for path, cited in sorted(citing_files().items()):
        for c in sorted(cited):
            names = {"archive/" + a for a in archived} if c.startswith("archive/") else kept | {INDEX}
            if not _resolve(c, names):
                where = " (it is in results/archive/)" if _resolve(c, archived) else ""
                missing.append(f"{path} cites results/{c}{where}")
    assert not missing, "cited results that are not in benchmarks/results/:\n" + "\n".join(missing)


def test_every_kept_result_is_cited():
    kept, _ = _files()
    uncited = sorted(name for name in kept if why_kept(name) is None)
    assert not uncited, ("results no doc, README, script, test or module cites (cite them, or git mv them to "
                         "benchmarks/results/archive/):\n" + "\n".join(uncited))


def _index_rows() -> dict[str, list[str]]:
    """INDEX.md's table: file -> the citers its last column names."""
    rows = {}
    for line in _read(os.path.join(RESULTS, INDEX)).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[-1])
    return rows


def test_index_lists_every_kept_result_and_who_cites_it():
    kept, _ = _files()
    rows = _index_rows()
    assert set(rows) == set(kept), (f"INDEX.md lists files not kept: {sorted(set(rows) - kept)}; "
                                    f"kept files it does not list: {sorted(kept - set(rows))}")
    wrong = []
    for name, citers in sorted(rows.items()):
        if not citers:
            wrong.append(f"{name}: no citer named")
        for citer in citers:
            if citer in kept:  # a report: names it, or it is the report's data
                ok = _cites(citer, name) or name == citer[:-len(".md")] + ".json"
            else:
                ok = name in cited_by_docs() and citer in cited_by_docs()[name]
            if not ok:
                wrong.append(f"{name}: INDEX.md says {citer} cites it; it does not")
    assert not wrong, "\n".join(wrong)


def test_kept_reports_resolve_their_citations():
    kept, archived = _files()
    broken = []
    for report in sorted(n for n in kept if n.endswith(".md")):
        text = _read(os.path.join(RESULTS, report))
        for c in sorted(citations(text, outputs=True)):
            if not _resolve(c.removeprefix("archive/"), archived if c.startswith("archive/") else kept | archived):
                broken.append(f"{report} names {c}, which is nowhere in results/")
        for target in LINK_RE.findall(text):
            if "://" not in target and target.endswith((".md", ".json", ".png")) \
                    and not os.path.exists(os.path.join(RESULTS, target)):
                broken.append(f"{report} links to {target}, which is not in results/")
    assert not broken, "\n".join(broken)


HEADER_LINES = 12
HEX_RE = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commits(candidates: set[str]) -> set[str]:
    """The candidates that name a commit of this repository; outside a git checkout, those
    that could (hex with a letter in it, not a number)."""
    if not os.path.isdir(os.path.join(REPO, ".git")):
        return {c for c in candidates if re.search("[a-f]", c)}
    ordered = sorted(candidates)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, capture_output=True, text=True, check=True,
                         input="".join(f"{c}^{{commit}}\n" for c in ordered)).stdout.splitlines()
    return {c for c, line in zip(ordered, out) if not line.endswith("missing") and "ambiguous" not in line}


def test_kept_reports_name_the_code_they_measured():
    kept, _ = _files()
    heads = {report: HEX_RE.findall("\n".join(_read(os.path.join(RESULTS, report)).splitlines()[:HEADER_LINES]))
             for report in sorted(n for n in kept if n.endswith(".md"))}
    commits = _commits({c for found in heads.values() for c in found})
    unnamed = [report for report, found in heads.items() if not commits.intersection(found)]
    assert not unnamed, (f"reports whose first {HEADER_LINES} lines name no commit of this repository (write them "
                         "with benchmarks/reporting.publish, or name the commit they measured):\n" + "\n".join(unnamed))
