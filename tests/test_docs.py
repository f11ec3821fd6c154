"""The documentation stays honest: the site builds in strict mode, every ``gc.`` name the README
and docs/ use resolves after ``import gradcomp as gc``, the README stays short and names CI's
test command, and every results page says where its figures come from."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 320
# the command .ci/run runs, which the README gives as the way to run the tests
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest -q'

# a fenced block: ```lang ... ``` at the start of a line
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.M | re.S)
# `gc.a.b` chains: gc not preceded by a word character or a dot (not torch.gc, not abc.x)
_CHAIN = re.compile(r"(?<![\w.])gc((?:\.[A-Za-z_]\w*)+)")
_INLINE = re.compile(r"`([^`\n]+)`")


def _markdown_files() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _chains(text: str) -> set[str]:
    """Every ``gc.name(.name)*`` in the text's fenced python blocks and inline code spans."""
    found = set()
    for lang, body in _FENCE.findall(text):
        if lang in ("python", "py", "pycon"):
            found.update("gc" + m.group(1) for m in _CHAIN.finditer(body))
    outside = _FENCE.sub("", text)
    for span in _INLINE.findall(outside):
        found.update("gc" + m.group(1) for m in _CHAIN.finditer(span))
    return found


def _unresolved(chains) -> dict[str, str]:
    """``chain -> reason`` for every chain that does not resolve: its first name must be a
    public name of gradcomp (``gradcomp.__all__``: what a fresh ``import gradcomp as gc``
    offers, not a submodule another import happened to load), the rest attributes."""
    import gradcomp as gc

    public = set(gc.__all__)
    failed = {}
    for chain in sorted(chains):
        names = chain.split(".")[1:]
        if names[0] not in public:
            failed[chain] = f"{names[0]!r} is not a public name of gradcomp (not in gradcomp.__all__)"
            continue
        obj = gc
        for i, name in enumerate(names):
            try:
                obj = getattr(obj, name)
            except AttributeError as e:
                failed[chain] = f"{'.'.join(['gc', *names[:i + 1]])}: {e}"
                break
    return failed


def test_the_scan_finds_chains_in_blocks_and_spans_only():
    text = ("```python\nimport gradcomp as gc\nq = gc.Int8Quantizer(block_size=256)\n"
            "torch.gc.collect(); abc.x\ns = gc.ddp.GradCompState(compressor=q)\n```\n"
            "Prose gc.NotCode, `gc.fsdp.apply` in a span.\n"
            "```bash\ngc.NotPython\n```\n")
    assert _chains(text) == {"gc.Int8Quantizer", "gc.ddp.GradCompState", "gc.fsdp.apply"}


def test_the_resolver_reports_what_does_not_resolve():
    failed = _unresolved({"gc.Int8Quantizer", "gc.ddp.GradCompState", "gc.NoSuchName",
                          "gc.ddp.NoSuchName", "gc.lab"})
    assert set(failed) == {"gc.NoSuchName", "gc.ddp.NoSuchName", "gc.lab"}


def test_every_gc_name_in_the_readme_and_docs_resolves():
    where: dict[str, list[str]] = {}
    for path in _markdown_files():
        for chain in _chains(path.read_text()):
            where.setdefault(chain, []).append(str(path.relative_to(ROOT)))
    # the scan finds what it should (a broken pattern would find nothing and pass)
    assert {"gc.Int8Quantizer", "gc.ErrorFeedback", "gc.ddp.GradCompState",
            "gc.ddp.compressed_allreduce_hook", "gc.allreduce", "gc.fsdp.apply"} <= set(where)
    failed = _unresolved(where)
    assert not failed, "names in the docs that do not resolve after `import gradcomp as gc`:\n" + \
        "\n".join(f"  {c} ({', '.join(sorted(set(where[c])))}): {why}" for c, why in failed.items())


def _mentions(pattern: str) -> dict[str, str]:
    """Each match of ``pattern`` inside an inline code span of the README and docs/ -> a file
    that mentions it."""
    found = {}
    for path in _markdown_files():
        for span in _INLINE.findall(_FENCE.sub("", path.read_text())):
            for m in re.finditer(pattern, span):
                found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute of the longest importable module prefix."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("gradcomp"):
                return True  # an optional dependency (triton, cupy) is missing here, not the name
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_path_and_module_the_docs_name_exists():
    paths = _mentions(r"(?<![\w./-])((?:gradcomp|benchmarks|examples|tests|csrc)/[\w./*-]*\w/?)")
    assert "gradcomp/wire.py" in paths and "examples/ddp_hook.py" in paths
    missing = [f"{p} ({where})" for p, where in paths.items()
               if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"paths in the docs that do not exist: {missing}"
    dotted = _mentions(r"(?<![\w.])(gradcomp(?:\.[A-Za-z]\w*)+)")  # public dotted names
    assert "gradcomp.adaptive.CONVERGENCE" in dotted
    unresolved = [f"{d} ({where})" for d, where in dotted.items() if not _resolves(d)]
    assert not unresolved, f"dotted names in the docs that do not resolve: {unresolved}"


def test_the_readme_is_short_and_gives_ci_s_test_command():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert TEST_COMMAND in README.read_text()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()
    assert 'pip install ".[train]" && gradcomp train' in README.read_text()


def test_the_readme_links_resolve():
    # the site's build checks the docs' links; the README is outside it
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert "docs/index.md" in local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_results_page_says_where_its_figures_come_from():
    results = DOCS / "results"
    pages = sorted(p for p in results.glob("*.md") if p.name != "index.md")
    assert len(pages) >= 5
    index = (results / "index.md").read_text()
    for page in pages:
        text = page.read_text()
        assert f"]({page.name})" in index, f"results/index.md does not list {page.name}"
        assert re.search(r"^\| date \| 20\d\d-\d\d-\d\d", text, re.M), f"{page.name}: no date row"
        assert re.search(r"`[0-9a-f]{7,40}`", text), f"{page.name}: no commit"
        assert "| host |" in text, f"{page.name}: no host row"


def _anchors(page: pathlib.Path) -> set[str]:
    """The ids MkDocs gives a page's headings (the toc extension's default slugify)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", _FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}


def test_every_doc_page_the_code_points_to_exists():
    # module docstrings link to their doc page ("docs/adaptive.md"): a renamed page breaks them
    pointer = re.compile(r"\bdocs/[\w./-]+?\.(?:md|png)\b(?:#[\w-]+)?")
    sources = [*ROOT.glob("gradcomp/**/*.py"), *ROOT.glob("benchmarks/*"), *ROOT.glob("examples/*.py"),
               *ROOT.glob("tests/*.py"), ROOT / ".ci" / "run", ROOT / "mkdocs.yml"]
    seen, missing = set(), []
    for path in sources:
        if not path.is_file():
            continue
        for ref in pointer.findall(path.read_text(errors="replace")):
            page, _, anchor = ref.partition("#")
            seen.add(page)
            if not (ROOT / page).is_file() or (anchor and anchor not in _anchors(ROOT / page)):
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert "docs/settings.md" in seen  # the scan finds what it should
    assert not missing, f"doc pages the code names that do not exist: {missing}"


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # the API reference was generated from the docstrings, not left empty
    api = (site / "api" / "compressors" / "index.html").read_text()
    assert 'id="gradcomp.compressors.Int8Quantizer"' in api
    assert (site / "results" / "index.html").exists()
