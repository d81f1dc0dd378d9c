"""Key-value stores: the Store API, in-process stores and the TCP store."""

from rdzv.store.base import Store
from rdzv.store.memory import HashStore, PrefixStore

__all__ = ["HashStore", "PrefixStore", "Store"]
