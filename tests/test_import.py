"""`import gradcomp` stays light: no native module, Triton, CuPy or CUDA init."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_import_is_light():
    code = (
        "import sys, gradcomp, torch\n"
        "import gradcomp as gc\n"
        "x = gc.Int8Quantizer()\n"
        "bad = [m for m in ('gradcomp._C', 'triton', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_public_names():
    import gradcomp as gc

    for name in ["NoCompression", "FP16", "BF16", "Int8Quantizer", "TopK", "Threshold",
                 "ErrorFeedback", "TrafficMeter", "PayloadError", "decode", "kernels"]:
        assert hasattr(gc, name), name
    assert issubclass(gc.PayloadError, ValueError)


def test_every_exported_name_resolves():
    import gradcomp as gc

    for name in gc.__all__:
        assert getattr(gc, name) is not None, name
        assert name in dir(gc)
    assert gc.Int8Quantizer.__module__.startswith("gradcomp.compressors")
    assert gc.ddp.__name__ == "gradcomp.ddp" and callable(gc.allreduce)
    try:
        gc.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("gc.no_such_name resolved")


def test_dir_of_the_kernels_lists_the_public_api_only():
    import gradcomp as gc

    assert dir(gc.kernels) == sorted(gc.kernels.__all__)
    for name in gc.kernels.__all__:
        assert callable(getattr(gc.kernels, name)), name


def api_problems(mod) -> list[str]:
    """What is wrong with ``mod``'s public names: no ``__all__``, a listed name that does not
    resolve, or a public function or class defined in ``mod`` (``__module__`` is ``mod``) that
    ``dir(mod)`` shows but ``__all__`` omits. Imported names, submodules, TypeVars and private
    names are not the module's API; constants are not checked (where a constant was defined is
    not visible at run time)."""
    import inspect
    import types
    import typing

    name = mod.__name__
    listed = getattr(mod, "__all__", None)
    if listed is None:
        return [f"{name}: no __all__"]
    problems = [f"{name}.__all__ names {n!r}, which does not exist" for n in listed if not hasattr(mod, n)]
    for n in dir(mod):
        if n.startswith("_") or n in listed:
            continue
        v = getattr(mod, n)
        if isinstance(v, (types.ModuleType, typing.TypeVar)):
            continue
        if (inspect.isfunction(v) or inspect.isclass(v)) and getattr(v, "__module__", None) == name:
            problems.append(f"{name}.{n} is defined there but not in __all__")
    return problems


def _missing_optional_dependency(e: ImportError) -> bool:
    # a module of an optional extra (lightning, torchft, cupy) whose dependency is not installed;
    # a broken import of gradcomp's own is a failure
    missing = getattr(e, "name", None) or ""
    return isinstance(e, ModuleNotFoundError) and missing.split(".")[0] != "gradcomp"


def test_the_public_api_check_finds_each_kind_of_leak():
    import types

    mod = types.ModuleType("fake_mod")
    assert api_problems(mod) == ["fake_mod: no __all__"]

    def helper():
        pass

    helper.__module__ = "fake_mod"
    mod.__all__ = ["gone"]
    mod.helper, mod.sys, mod.imported = helper, sys, subprocess.run
    assert api_problems(mod) == ["fake_mod.__all__ names 'gone', which does not exist",
                                 "fake_mod.helper is defined there but not in __all__"]
    mod.__all__ = ["helper"]
    assert api_problems(mod) == []
    assert _missing_optional_dependency(ModuleNotFoundError("x", name="lightning.pytorch"))
    assert not _missing_optional_dependency(ModuleNotFoundError("x", name="gradcomp.nothing"))


@pytest.mark.slow
def test_every_public_module_lists_its_public_names():
    # a fresh interpreter: importing every module (the Triton and CUDA kernel modules among them)
    # must not change the kernels the other tests' process dispatches to
    import inspect

    code = "\n".join([
        "import importlib, json, pkgutil, sys",
        "import gradcomp",
        inspect.getsource(api_problems),
        inspect.getsource(_missing_optional_dependency),
        "problems, checked, skipped = [], 0, []",
        "for info in pkgutil.walk_packages(gradcomp.__path__, 'gradcomp.', onerror=lambda n: None):",
        "    if any(part.startswith('_') for part in info.name.split('.')[1:]):",
        "        continue",
        "    try:",
        "        mod = importlib.import_module(info.name)",
        "    except ImportError as e:",
        "        if not _missing_optional_dependency(e):",
        "            raise",
        "        skipped.append(info.name)",
        "        continue",
        "    checked += 1",
        "    problems += api_problems(mod)",
        "print(json.dumps({'problems': problems, 'checked': checked, 'skipped': skipped}))",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["problems"], "\n".join(out["problems"])
    # the walk reached the library and the lab (not an empty package path)
    assert out["checked"] >= 130, out
