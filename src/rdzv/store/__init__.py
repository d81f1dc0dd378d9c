"""Key-value stores: the Store API, in-process stores and the TCP store.

Names are imported lazily, so a client (``rdzv.store.tcp``) does not load
the server and its event loop machinery unless it hosts one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv._lazy import lazy_exports

# The public names: name -> the module that defines it (see rdzv/__init__.py).
_EXPORTS: dict[str, str] = {
    "HashStore": "rdzv.store.memory",
    "PrefixStore": "rdzv.store.memory",
    "Store": "rdzv.store.base",
    "TCPStore": "rdzv.store.tcp",
    "TCPStoreServer": "rdzv.store.server",
}

__all__ = [*_EXPORTS]  # noqa: PLE0604 - derived from the one list

if TYPE_CHECKING:
    from rdzv.store.base import Store as Store
    from rdzv.store.memory import HashStore as HashStore
    from rdzv.store.memory import PrefixStore as PrefixStore
    from rdzv.store.server import TCPStoreServer as TCPStoreServer
    from rdzv.store.tcp import TCPStore as TCPStore


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
