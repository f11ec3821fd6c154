"""Package attributes loaded on first use (PEP 562), so that importing a package stays light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_attributes", "after_import"]


def lazy_attributes(package: str, namespace: dict,
                    exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names load on first use.

    Args:
        package: the package's name (``__name__``), for error messages.
        namespace: the package's ``globals()``: a loaded name is stored there,
            so later lookups skip ``__getattr__``.
        exports: public name -> the module that defines it; a name equal to
            its module's last component is that module itself
            (``gradcomp.kernels``).

    Returns:
        ``(__getattr__, __dir__)``; assign both at the package's top level.
        ``__getattr__`` raises AttributeError for a name not in ``exports``.
    """
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = importlib.import_module(module)
        value = mod if module == f"{package}.{name}" else getattr(mod, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__


def after_import(name: str, callback: Callable[[], object]) -> None:
    """Call ``callback()`` once the top-level module ``name`` is imported: now if it already is,
    else right after its first import finishes.

    ``import gradcomp`` must not import torch (``gradcomp --help`` stays fast), yet the
    ``torch.ops.gradcomp.*`` ops must exist as soon as both are imported, in either order: this
    is the one place that waits for torch.

    Args:
        name: a top-level module name (``"torch"``).
        callback: called with no arguments, once; its exceptions propagate to the import.
    """
    if name in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport:
    """A one-shot finder: finds ``name``'s spec with the other finders, then runs ``callback``
    after the module's own code (the standard post-import hook pattern; a meta path finder
    needs only ``find_spec``, and importlib.abc would cost more than all of gradcomp's import)."""

    def __init__(self, name: str, callback: Callable[[], object]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the lookup below must not find this finder again
        import importlib.util  # loaded by the time any module is imported: no start-up cost

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_call(module):
            exec_module(module)
            sys.modules[fullname] = module  # the callback imports modules that import this one
            callback()

        spec.loader.exec_module = exec_then_call  # this spec's loader only
        return spec
