"""docs/settings.md and the sources agree, both ways: the page names every environment variable
gradcomp reads and every piece of module-level mutable state (found here by reading the
sources, not by a list), and everything the page names still exists in the sources."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradcomp"
PAGE = ROOT / "docs" / "settings.md"

# os.environ.get("X"), os.environ["X"], env.get("X"), os.getenv("X"), "X" in os.environ,
# and any "GRADCOMP_..." literal (a constant naming a variable, as gradcomp.ps.transport.HOST_ENV)
_ENV_READ = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["']"""
                       r"""|getenv\(\s*["']([A-Z][A-Z0-9_]+)["']"""
                       r"""|["']([A-Z][A-Z0-9_]+)["']\s+in\s+os\.environ"""
                       r"""|["'](GRADCOMP_[A-Z0-9_]+)["']""")
_STATE_CALLS = {"dict", "list", "set", "deque", "defaultdict", "Counter", "WeakKeyDictionary",
                "WeakValueDictionary", "local", "count", "Lock", "RLock", "lazy_attributes"}
_MEMO_DECORATORS = {"lru_cache", "cache"}
_TICKED = re.compile(r"`([^`]+)`")


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _first_cells(title: str) -> list[str]:
    """The first cell of every body row of the table under ``## title``."""
    rows = [line for line in _section(title).splitlines() if line.startswith("| `")]
    return [row.split("|")[1] for row in rows]


def _sources():
    yield ROOT / "setup.py"
    yield from sorted(PACKAGE.rglob("*.py"))


def _env_names() -> dict[str, str]:
    names = {}
    for path in _sources():
        for m in _ENV_READ.finditer(path.read_text()):
            names.setdefault(next(g for g in m.groups() if g), str(path.relative_to(ROOT)))
    return names


def _call_name(node) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def _empty_literal(node) -> bool:
    if isinstance(node, ast.Dict):
        return not node.keys
    return isinstance(node, (ast.List, ast.Set)) and not node.elts


def _target_names(targets) -> list[str]:
    names = []
    for t in targets:
        if isinstance(t, ast.Name):
            names.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            names += _target_names(t.elts)
    return names


def _memoised(node) -> bool:
    return any((_call_name(d) if isinstance(d, ast.Call) else
                d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else None)
               in _MEMO_DECORATORS for d in node.decorator_list)


def _module_state() -> list[tuple[str, str]]:
    """``(path under gradcomp/, name)`` of every module-level container, lock, counter,
    thread-local or lazy namespace created at import, every memoised (``lru_cache``)
    function, and every name a function rebinds with ``global``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(PACKAGE))
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _empty_literal(node.value) or _call_name(node.value) in _STATE_CALLS:
                    found += [(rel, name) for name in _target_names(targets)]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _memoised(node):
                found.append((rel, node.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [(rel, name) for name in node.names]
    return sorted(set(found))


def _module_names(path: pathlib.Path) -> set[str]:
    """Names bound at the top level of a module (assignments, defs, classes, imports) or
    declared ``global`` in it."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(_target_names(node.targets))
        elif isinstance(node, ast.AnnAssign):
            names.update(_target_names([node.target]))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    return names


def _documented_state(cells: list[str]) -> list[tuple[str, list[str]]]:
    """``(path, names)`` per row: the row's backticked ``*.py`` path and the other backticked names."""
    rows = []
    for cell in cells:
        ticked = _TICKED.findall(cell)
        paths = [t for t in ticked if t.endswith(".py")]
        assert len(paths) == 1, f"a state row names one file: {cell.strip()}"
        rows.append((paths[0], [t for t in ticked if not t.endswith(".py")]))
    return rows


def _stale_state(rows: list[tuple[str, list[str]]]) -> list[str]:
    """``path:name`` of every documented piece of state whose file or name no longer exists."""
    stale = []
    for path, names in rows:
        source = PACKAGE / path
        if not source.is_file():
            stale += [f"{path} (no such file)"]
            continue
        bound = _module_names(source)
        stale += [f"{path}:{name}" for name in names if name not in bound]
    return stale


def _documented_env() -> list[str]:
    return [n for cell in _first_cells("Environment variables") for n in _TICKED.findall(cell)]


def test_every_environment_variable_read_is_documented():
    names = _env_names()
    # the scan finds what it should (a broken pattern would find nothing and pass)
    assert {"GRADCOMP_BACKEND", "GRADCOMP_PS_HOST", "MASTER_ADDR", "RANK", "WORLD_SIZE",
            "GRADCOMP_START_METHOD", "TRITON_INTERPRET", "GRADCOMP_NO_NATIVE", "CXX"} <= set(names)
    documented = set(_documented_env())
    missing = [f"{n} ({where})" for n, where in names.items() if n not in documented]
    assert not missing, f"environment variables read but not in docs/settings.md: {missing}"


def test_every_documented_environment_variable_is_still_read():
    documented = _documented_env()
    assert "GRADCOMP_BACKEND" in documented and "CXX" in documented
    read = _env_names()
    stale = [n for n in documented if n not in read]
    assert not stale, f"docs/settings.md names environment variables no source reads: {stale}"


def test_every_module_level_mutable_state_is_documented():
    state = _module_state()
    assert ("comm/guard.py", "_IN_USE") in state and ("kernels/cpu.py", "_native_module") in state
    assert ("lab/plan/costs.py", "wire_nbytes") in state          # an lru_cache memo
    rows = _documented_state(_first_cells("Module-level state"))
    missing = [f"{path}:{name}" for path, name in state
               if not any(path == p and name in names for p, names in rows)]
    assert not missing, f"module-level state not in docs/settings.md: {missing}"


def test_every_documented_state_still_exists():
    rows = _documented_state(_first_cells("Module-level state"))
    assert ("comm/guard.py", ["_IN_USE", "_LOCK"]) in rows
    stale = _stale_state(rows)
    assert not stale, f"docs/settings.md names state the sources no longer have: {stale}"


def test_a_stale_row_is_reported():
    # the reverse check can fail: a removed name, a renamed file
    assert _stale_state([("comm/guard.py", ["_IN_USE", "_GONE"]), ("gone.py", ["_x"])]) == \
        ["comm/guard.py:_GONE", "gone.py (no such file)"]
