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

# The public names: name -> the module that defines it. ``__all__`` is
# derived from it; the imports for type checkers below must name the same
# (tests/unit/test_public_names.py checks it).
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

__all__ = [*_EXPORTS, "__version__"]  # noqa: PLE0604 - derived from the one list

if TYPE_CHECKING:
    from rdzv.api import RendezvousHandler as RendezvousHandler
    from rdzv.api import RendezvousInfo as RendezvousInfo
    from rdzv.api import RendezvousParameters as RendezvousParameters
    from rdzv.api import RendezvousSettings as RendezvousSettings
    from rdzv.api import RendezvousStoreInfo as RendezvousStoreInfo
    from rdzv.api import RendezvousTimeout as RendezvousTimeout
    from rdzv.backends.base import RendezvousBackend as RendezvousBackend
    from rdzv.backends.etcd import EtcdRendezvousBackend as EtcdRendezvousBackend
    from rdzv.backends.store import C10dRendezvousBackend as C10dRendezvousBackend
    from rdzv.backends.store import P10dRendezvousBackend as P10dRendezvousBackend
    from rdzv.backends.store import TpRendezvousBackend as TpRendezvousBackend
    from rdzv.dynamic.handler import DynamicRendezvousHandler as DynamicRendezvousHandler
    from rdzv.endpoint import parse_config as parse_config
    from rdzv.endpoint import parse_endpoint as parse_endpoint
    from rdzv.errors import RendezvousClosedError as RendezvousClosedError
    from rdzv.errors import RendezvousConnectionError as RendezvousConnectionError
    from rdzv.errors import RendezvousError as RendezvousError
    from rdzv.errors import RendezvousExhaustedError as RendezvousExhaustedError
    from rdzv.errors import RendezvousGracefulExitError as RendezvousGracefulExitError
    from rdzv.errors import RendezvousStateError as RendezvousStateError
    from rdzv.errors import RendezvousTimeoutError as RendezvousTimeoutError
    from rdzv.errors import StoreAuthenticationError as StoreAuthenticationError
    from rdzv.errors import StoreTimeoutError as StoreTimeoutError
    from rdzv.registry import RendezvousHandlerCreator as RendezvousHandlerCreator
    from rdzv.registry import RendezvousHandlerRegistry as RendezvousHandlerRegistry
    from rdzv.registry import create_handler as create_handler
    from rdzv.registry import get_registry as get_registry
    from rdzv.registry import rendezvous_handler_registry as rendezvous_handler_registry
    from rdzv.static import StaticTCPRendezvous as StaticTCPRendezvous
    from rdzv.store.base import Store as Store
    from rdzv.store.memory import HashStore as HashStore
    from rdzv.store.memory import PrefixStore as PrefixStore
    from rdzv.store.server import TCPStoreServer as TCPStoreServer
    from rdzv.store.tcp import TCPStore as TCPStore
    from rdzv.utils import parse_rendezvous_endpoint as parse_rendezvous_endpoint
    from rdzv.worker import progress as progress


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
