"""Package attributes loaded on first use (PEP 562), so that importing a package stays light."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_attributes"]


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
