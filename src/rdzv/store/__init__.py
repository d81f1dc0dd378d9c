"""Key-value stores: the Store API, in-process stores and the TCP store."""

from rdzv.store.base import Store
from rdzv.store.memory import HashStore, PrefixStore
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore

__all__ = ["HashStore", "PrefixStore", "Store", "TCPStore", "TCPStoreServer"]
