"""Lazy public names for a package: imported from their module on first use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build a package's module-level ``__getattr__`` and ``__dir__``.

    Args:
        package: The package's ``__name__`` (already in ``sys.modules``).
        exports: Public name -> the module that defines it.

    Returns:
        ``(__getattr__, __dir__)``; a name, once loaded, is cached in the
        package's namespace, so its module is imported only once.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - the module hook's name
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
