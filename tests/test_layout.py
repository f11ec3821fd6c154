"""The house rules of ../shared/LAYOUT.md, read from the sources (rules 1, 5-8 and docstring ceilings).

Each rule has an allow-list of today's exceptions that may only shrink: an exception that grows
fails, and one that no longer occurs fails too until it is removed from its list.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradcomp"
LAB = "gradcomp.lab"

# entry points may start the lab (``python -m gradcomp`` and ``python -m gradcomp.ps``), and the
# emulated cluster's old import path is an alias of its module (``from gradcomp.cluster import ...``)
LAB_ENTRY_POINTS = {"gradcomp.__main__", "gradcomp.ps.__main__", "gradcomp.cluster"}
# import cycles (strongly connected sets of modules) still to break
ALLOWED_CYCLES: list[set[str]] = []
# `from x import _y` across modules still to remove: "importer -> module._name"
ALLOWED_PRIVATE_IMPORTS: set[str] = set()
# module docstrings longer than MAX_MODULE_DOC_LINES: path -> today's length (may only shrink)
MAX_MODULE_DOC_LINES = 20
ALLOWED_LONG_MODULE_DOCS = {
    "gradcomp/lab/plan/model.py": 93, "gradcomp/ps/__init__.py": 96,
    "gradcomp/localsgd.py": 71, "gradcomp/lab/bench/kernels/__init__.py": 65,
    "gradcomp/lab/bench/allreduce.py": 63,
    "gradcomp/kernels/reference.py": 50,
    "gradcomp/ps/protocol.py": 49, "gradcomp/ddp.py": 48,
    "gradcomp/fsdp.py": 45,
    "gradcomp/lab/study/study.py": 33,
    "gradcomp/comm/pipelined.py": 33, "gradcomp/lab/study/local.py": 31,
    "gradcomp/kernels/cuda.py": 30,
    "gradcomp/lab/plan/__init__.py": 26,
    "gradcomp/kernels/triton/select.py": 26, "gradcomp/kernels/cpu.py": 25, "gradcomp/comm/local.py": 25,
    "gradcomp/timeline.py": 24, "gradcomp/lab/study/workloads.py": 24,
    "gradcomp/kernels/ops.py": 22,
    "gradcomp/lab/plan/profile.py": 21, "gradcomp/lab/plan/calibrate.py": 21,
    "gradcomp/kernels/registry.py": 21, "gradcomp/comm/allgather.py": 21,
}
# files longer than MAX_FILE_LINES (rule 1's soft ceiling): path -> today's length (may only shrink)
MAX_FILE_LINES = 600
ALLOWED_LONG_FILES = {
    "gradcomp/adaptive.py": 948, "gradcomp/lab/plan/model.py": 658, "gradcomp/lab/study/pipeline.py": 655,
}
# package __init__.py files that hold more than re-exports (rule 5)
ALLOWED_INIT_CODE = {"gradcomp/kernels/__init__.py", "gradcomp/kernels/triton/__init__.py",
                     "gradcomp/lab/study/__init__.py"}
# public names that several modules define on purpose, one meaning each: a kernel op in every
# backend that implements it, an algorithm's entry point in every algorithm module, a command's main
INTERFACE_NAMES = {
    "quantize_int8", "dequantize_int8", "dequantize_int8_add_", "quantize_int8_ef", "reduce_quantize_int8",
    "topk", "approx_topk", "threshold", "scatter_add_", "dgc_accumulate_", "dgc_topk_",
    "quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_", "reduce_quantize_packed",
    "quantize_sign", "quantize_sign_ef", "dequantize_sign", "dequantize_sign_add_",
    "quantize_fp8", "quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_",
    "devices", "unavailable_reason",  # what every kernel backend module answers
    "allreduce", "reduce_scatter",  # every algorithm module's entry points
    "main", "build_parser",  # every command's
}
# public names defined by two modules with different meanings, still to rename
ALLOWED_DUPLICATE_NAMES = {
    "measure", "measure_link", "plot",
    "print_report", "run", "run_study", "summary", "write_all", "write_plot", "check_schedule", "decode",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def _rel(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def _imports(module: str) -> list[tuple[str, str | None]]:
    """``(target module, imported name or None)`` of every gradcomp import in ``module``, at any
    depth (function-local imports included), and of ``importlib.import_module("gradcomp...")``."""
    out = []
    is_package = MODULES[module].name == "__init__.py"
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "gradcomp"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "gradcomp":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.append((sub, None) if sub in MODULES else (source, a.name))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("gradcomp")):
            out.append((node.args[0].value, None))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.add(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(scc)
    return found


def test_the_library_never_imports_the_lab():
    bad = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                 if not m.startswith(LAB) and m not in LAB_ENTRY_POINTS and t.startswith(LAB))
    assert not bad, bad
    # and importing the public API loads nothing of the lab
    import subprocess
    import sys

    code = ("import sys, torch, gradcomp as gc\n"
            "[getattr(gc, n) for n in gc.__all__]\n"
            "print(sorted(m for m in sys.modules if m.startswith('gradcomp.lab')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    new = [sorted(c) for c in cycles if c not in ALLOWED_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in cycles]
    assert not gone, f"no longer cycles, remove from ALLOWED_CYCLES: {gone}"


def test_no_private_names_imported_across_modules():
    found = {f"{m} -> {t}.{name}" for m in MODULES for t, name in _imports(m)
             if name and name.startswith("_") and not name.startswith("__") and t != m}
    assert found <= ALLOWED_PRIVATE_IMPORTS, sorted(found - ALLOWED_PRIVATE_IMPORTS)
    assert ALLOWED_PRIVATE_IMPORTS <= found, f"fixed, remove: {sorted(ALLOWED_PRIVATE_IMPORTS - found)}"


def test_public_names_have_one_meaning():
    where: dict[str, list[str]] = {}
    for m, tree in TREES.items():
        for node in tree.body:
            if (isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and not node.name.startswith("_")):
                where.setdefault(node.name, []).append(m)
    # a package's __init__ defining a name its submodule also defines is one definition too many
    dups = {n for n, ms in where.items() if len(ms) > 1 and n not in INTERFACE_NAMES}
    assert dups <= ALLOWED_DUPLICATE_NAMES, {n: where[n] for n in sorted(dups - ALLOWED_DUPLICATE_NAMES)}
    assert ALLOWED_DUPLICATE_NAMES <= dups, f"unique now, remove: {sorted(ALLOWED_DUPLICATE_NAMES - dups)}"


def _ceiling(lengths: dict[str, int], ceiling: int, allowed: dict[str, int], what: str) -> None:
    over = {p: n for p, n in lengths.items() if n > ceiling}
    new = {p: n for p, n in over.items() if p not in allowed}
    assert not new, f"{what} over {ceiling} lines: {new}"
    grown = {p: (allowed[p], n) for p, n in over.items() if p in allowed and n > allowed[p]}
    assert not grown, f"{what} grew past its allowance (allowed, now): {grown}"
    within = sorted(p for p in allowed if lengths.get(p, 0) <= ceiling)
    assert not within, f"{what} within {ceiling} lines now, remove from the allow-list: {within}"


def test_module_docstrings_within_the_ceiling():
    lengths = {}
    for m, tree in TREES.items():
        doc = ast.get_docstring(tree, clean=False)
        lengths[_rel(m)] = len(doc.splitlines()) if doc else 0
    _ceiling(lengths, MAX_MODULE_DOC_LINES, ALLOWED_LONG_MODULE_DOCS, "module docstrings")


def test_files_within_the_soft_ceiling():
    lengths = {_rel(m): len(MODULES[m].read_text().splitlines()) for m in MODULES}
    _ceiling(lengths, MAX_FILE_LINES, ALLOWED_LONG_FILES, "files")


def test_package_inits_only_re_export():
    code = set()
    for m, tree in TREES.items():
        if MODULES[m].name != "__init__.py":
            continue
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body):
            code.add(_rel(m))
    assert code <= ALLOWED_INIT_CODE, sorted(code - ALLOWED_INIT_CODE)
    assert ALLOWED_INIT_CODE <= code, f"re-exports only now, remove: {sorted(ALLOWED_INIT_CODE - code)}"


def test_the_cycle_finder_finds_a_planted_cycle():
    # the checks above are only as good as the graph search: it must find a known cycle and no other
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [{"a", "b", "c"}]
