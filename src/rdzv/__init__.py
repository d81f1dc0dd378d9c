"""rdzv: elastic rendezvous for distributed jobs.

Every public name of ``torch.distributed.elastic.rendezvous`` and of the
``tensorplay.distributed.elastic.rendezvous`` spec is importable from here,
and :func:`progress`, which a training loop under ``rdzv run --hang-timeout``
calls. Names are imported lazily, so ``import rdzv`` stays cheap.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rdzv._lazy import lazy_exports

#: The package version; the only place it is written (pyproject.toml reads it).
__version__ = "0.1.0"

# A library leaves logging to the application: without this handler Python's
# last-resort handler would print rdzv's warnings as bare lines on stderr.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "RendezvousError": "rdzv.errors",
    "RendezvousClosedError": "rdzv.errors",
    "RendezvousTimeoutError": "rdzv.errors",
    "RendezvousConnectionError": "rdzv.errors",
    "RendezvousStateError": "rdzv.errors",
    "RendezvousGracefulExitError": "rdzv.errors",
    "RendezvousExhaustedError": "rdzv.errors",
    "StoreTimeoutError": "rdzv.errors",
    "StoreAuthenticationError": "rdzv.errors",
    "TCPStore": "rdzv.store.tcp",
    "TCPStoreServer": "rdzv.store.server",
    "RendezvousTimeout": "rdzv.api",
    "RendezvousSettings": "rdzv.api",
    "RendezvousParameters": "rdzv.api",
    "RendezvousStoreInfo": "rdzv.api",
    "RendezvousInfo": "rdzv.api",
    "RendezvousHandler": "rdzv.api",
    "RendezvousHandlerCreator": "rdzv.registry",
    "RendezvousHandlerRegistry": "rdzv.registry",
    "rendezvous_handler_registry": "rdzv.registry",
    "create_handler": "rdzv.registry",
    "get_registry": "rdzv.registry",
    "RendezvousBackend": "rdzv.backends.base",
    "DynamicRendezvousHandler": "rdzv.dynamic.handler",
    "C10dRendezvousBackend": "rdzv.backends.store",
    "P10dRendezvousBackend": "rdzv.backends.store",
    "TpRendezvousBackend": "rdzv.backends.store",
    "Store": "rdzv.store.base",
    "HashStore": "rdzv.store.memory",
    "PrefixStore": "rdzv.store.memory",
    "parse_endpoint": "rdzv.endpoint",
    "parse_rendezvous_endpoint": "rdzv.utils",
    "parse_config": "rdzv.endpoint",
    "StaticTCPRendezvous": "rdzv.static",
    "EtcdRendezvousBackend": "rdzv.backends.etcd",
    "progress": "rdzv.worker",
}

__all__ = [
    "C10dRendezvousBackend",
    "DynamicRendezvousHandler",
    "EtcdRendezvousBackend",
    "HashStore",
    "P10dRendezvousBackend",
    "PrefixStore",
    "RendezvousBackend",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousExhaustedError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "StaticTCPRendezvous",
    "Store",
    "StoreAuthenticationError",
    "StoreTimeoutError",
    "TCPStore",
    "TCPStoreServer",
    "TpRendezvousBackend",
    "create_handler",
    "get_registry",
    "parse_config",
    "parse_endpoint",
    "parse_rendezvous_endpoint",
    "progress",
    "rendezvous_handler_registry",
    "__version__",
]

if TYPE_CHECKING:
    from rdzv.api import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
        RendezvousSettings,
        RendezvousStoreInfo,
        RendezvousTimeout,
    )
    from rdzv.backends.base import RendezvousBackend
    from rdzv.backends.etcd import EtcdRendezvousBackend
    from rdzv.backends.store import (
        C10dRendezvousBackend,
        P10dRendezvousBackend,
        TpRendezvousBackend,
    )
    from rdzv.dynamic.handler import DynamicRendezvousHandler
    from rdzv.endpoint import parse_config, parse_endpoint
    from rdzv.errors import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
        RendezvousExhaustedError,
        RendezvousGracefulExitError,
        RendezvousStateError,
        RendezvousTimeoutError,
        StoreAuthenticationError,
        StoreTimeoutError,
    )
    from rdzv.registry import (
        RendezvousHandlerCreator,
        RendezvousHandlerRegistry,
        create_handler,
        get_registry,
        rendezvous_handler_registry,
    )
    from rdzv.static import StaticTCPRendezvous
    from rdzv.store.base import Store
    from rdzv.store.memory import HashStore, PrefixStore
    from rdzv.store.server import TCPStoreServer
    from rdzv.store.tcp import TCPStore
    from rdzv.utils import parse_rendezvous_endpoint
    from rdzv.worker import progress


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
