"""Packaging: portable native build by default, extras that name each other instead of repeating."""

from __future__ import annotations

import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", requirement).group(0).lower()


def test_native_arch_is_opt_in():
    arch_flags = runpy.run_path(str(ROOT / "setup.py"))["arch_flags"]  # not __main__: no build
    assert arch_flags({}) == []
    assert arch_flags({"GRADCOMP_NATIVE_ARCH": "0"}) == []
    assert arch_flags({"GRADCOMP_NATIVE_ARCH": "1"}) == ["-march=native"]
    with pytest.raises(ValueError, match="GRADCOMP_NATIVE_ARCH must be 0 .* or 1"):
        arch_flags({"GRADCOMP_NATIVE_ARCH": "yes"})


def test_extras_name_each_other_instead_of_repeating():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["cuda"] == ["gradcomp[cuda12]"]
    test = [_name(r) for r in extras["test"]]
    assert "gradcomp[train]" in test
    assert not set(test) & {_name(r) for r in extras["train"]}  # named, not copied
    for key, reqs in extras.items():
        names = [_name(r) for r in reqs]
        assert len(names) == len(set(names)), key


def test_bench_extra_lists_only_what_the_benchmarks_import():
    extras = _pyproject()["project"]["optional-dependencies"]
    imports = {"scikit-learn": "sklearn"}  # distribution name -> import name, where they differ
    source = "\n".join(p.read_text() for p in (ROOT / "gradcomp" / "lab" / "bench").rglob("*.py"))
    for req in extras["bench"]:
        module = imports.get(_name(req), _name(req))
        assert re.search(rf"^\s*(import|from) {re.escape(module)}\b", source, re.M), req
