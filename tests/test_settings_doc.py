"""README "Settings and global state" names every environment variable gradcomp reads and
every piece of module-level mutable state (found here by reading the sources, not by a list)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradcomp"

# os.environ.get("X"), os.environ["X"], env.get("X"), os.getenv("X"), "X" in os.environ,
# and any "GRADCOMP_..." literal (a constant naming a variable, as gradcomp.ps.transport.HOST_ENV)
_ENV_READ = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["']"""
                       r"""|getenv\(\s*["']([A-Z][A-Z0-9_]+)["']"""
                       r"""|["']([A-Z][A-Z0-9_]+)["']\s+in\s+os\.environ"""
                       r"""|["'](GRADCOMP_[A-Z0-9_]+)["']""")
_STATE_CALLS = {"dict", "list", "set", "deque", "defaultdict", "Counter", "WeakKeyDictionary",
                "WeakValueDictionary", "local", "count", "Lock", "RLock"}


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Settings and global state")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


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


def _module_state() -> list[tuple[str, str]]:
    """``(path under gradcomp/, name)`` of every module-level container, lock, counter or
    thread-local created empty, and of every name a function rebinds with ``global``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(PACKAGE))
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _empty_literal(node.value) or _call_name(node.value) in _STATE_CALLS:
                    found += [(rel, t.id) for t in targets if isinstance(t, ast.Name)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [(rel, name) for name in node.names]
    return sorted(set(found))


def test_every_environment_variable_read_is_documented():
    names = _env_names()
    # the scan finds what it should (a broken pattern would find nothing and pass)
    assert {"GRADCOMP_BACKEND", "GRADCOMP_PS_HOST", "MASTER_ADDR", "RANK", "WORLD_SIZE",
            "GRADCOMP_START_METHOD", "TRITON_INTERPRET", "GRADCOMP_NO_NATIVE", "CXX"} <= set(names)
    section = _section()
    missing = [f"{n} ({where})" for n, where in names.items() if f"`{n}`" not in section]
    assert not missing, f"environment variables read but not in README 'Settings and global state': {missing}"


def test_every_module_level_mutable_state_is_documented():
    state = _module_state()
    assert ("comm/guard.py", "_IN_USE") in state and ("kernels/cpu.py", "_native_module") in state
    rows = [line for line in _section().splitlines() if line.startswith("| `")]
    missing = [f"{path}:{name}" for path, name in state
               if not any(f"`{path}`" in row and f"`{name}`" in row for row in rows)]
    assert not missing, f"module-level state not in README 'Settings and global state': {missing}"
