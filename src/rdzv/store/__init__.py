"""Key-value stores: the Store API, in-process stores and the TCP store.

Names are imported lazily, so a client (``rdzv.store.tcp``) does not load
the server and its event loop machinery unless it hosts one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "HashStore": "rdzv.store.memory",
    "PrefixStore": "rdzv.store.memory",
    "Store": "rdzv.store.base",
    "TCPStore": "rdzv.store.tcp",
    "TCPStoreServer": "rdzv.store.server",
}

__all__ = ["HashStore", "PrefixStore", "Store", "TCPStore", "TCPStoreServer"]

if TYPE_CHECKING:
    from rdzv.store.base import Store
    from rdzv.store.memory import HashStore, PrefixStore
    from rdzv.store.server import TCPStoreServer
    from rdzv.store.tcp import TCPStore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rdzv.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
