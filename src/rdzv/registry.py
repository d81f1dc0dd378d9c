"""The registry that maps backend names to handler creators.

Built-in backends are listed in ``_BUILTIN`` as ``module:function`` paths and
imported only when used. Backends from other packages register through the
entry-point group ``rdzv.handlers``: each entry point names a creator
``(RendezvousParameters) -> RendezvousHandler``. Entry points are loaded once,
lazily, the first time a name is looked up; one that fails to load produces
a warning, not a crash.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable
from importlib import metadata

from rdzv.api import RendezvousHandler, RendezvousParameters

__all__ = [
    "ENTRY_POINT_GROUP",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "create_handler",
    "rendezvous_handler_registry",
]

ENTRY_POINT_GROUP = "rdzv.handlers"

RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]

# name -> "module:function"; the module is imported on first use.
_BUILTIN: dict[str, str] = {
    "static": "rdzv.static:create_rdzv_handler",
    "c10d": "rdzv.dynamic.handler:create_c10d_handler",
    "p10d": "rdzv.dynamic.handler:create_c10d_handler",
    "core": "rdzv.dynamic.handler:create_c10d_handler",
    "tcp": "rdzv.dynamic.handler:create_c10d_handler",
    "etcd": "rdzv.backends.etcd:create_etcd_handler",
    "etcd-v2": "rdzv.backends.etcd:create_etcd_handler",
    "redis": "rdzv.backends.redis:create_redis_handler",
}


def _lazy(path: str) -> RendezvousHandlerCreator:
    module_name, _, function_name = path.partition(":")

    def create(params: RendezvousParameters) -> RendezvousHandler:
        module = importlib.import_module(module_name)
        creator: RendezvousHandlerCreator = getattr(module, function_name)
        return creator(params)

    create.__qualname__ = create.__name__ = f"lazy[{path}]"
    return create


class RendezvousHandlerRegistry:
    """Maps backend names to creators of rendezvous handlers."""

    def __init__(self, load_entry_points: bool = True) -> None:
        """Create an empty registry.

        Args:
            load_entry_points: Load the ``rdzv.handlers`` entry points the
                first time a name is looked up.
        """
        self._creators: dict[str, RendezvousHandlerCreator] = {}
        self._origins: dict[str, str] = {}
        self._lock = threading.RLock()
        self._entry_points_loaded = not load_entry_points

    def register(
        self, backend: str, creator: RendezvousHandlerCreator, origin: str | None = None
    ) -> None:
        """Register a creator under a backend name.

        Registering the same creator again is allowed; a different creator
        for a taken name is not.

        Args:
            backend: The backend name.
            creator: Builds a handler from :class:`RendezvousParameters`.
            origin: Where the creator came from, shown by ``rdzv backends``.

        Raises:
            ValueError: The name is empty or already taken by another creator.
        """
        if not isinstance(backend, str) or not backend.strip():
            raise ValueError(f"the backend name must be a non-empty string, got {backend!r}")
        with self._lock:
            current = self._creators.get(backend)
            if current is not None:
                if current is creator:
                    return
                raise ValueError(
                    f"the rendezvous backend {backend!r} cannot be registered with {creator!r} "
                    f"as it is already registered with {current!r} (from {self._origins[backend]})"
                )
            self._creators[backend] = creator
            self._origins[backend] = origin or getattr(creator, "__module__", "?") or "?"

    def _load_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = getattr(entry_point, "dist", None)
                source = f"entry point {entry_point.value}" + (
                    f" in {dist.name} {dist.version}" if dist is not None else ""
                )
                try:
                    creator = entry_point.load()
                    self.register(entry_point.name, creator, origin=source)
                except Exception as exc:  # noqa: BLE001 - a broken plugin must not crash us
                    warnings.warn(
                        f"rdzv: could not load rendezvous backend {entry_point.name!r} "
                        f"from {source}: {type(exc).__name__}: {exc}",
                        RuntimeWarning,
                        stacklevel=3,
                    )

    def backends(self) -> dict[str, str]:
        """Return every registered backend name with where it came from.

        Returns:
            ``{name: origin}``, sorted by name.
        """
        self._load_entry_points()
        with self._lock:
            return dict(sorted(self._origins.items()))

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Build the handler for ``params.backend``.

        Args:
            params: The rendezvous parameters.

        Returns:
            A new handler.

        Raises:
            ValueError: The backend is not registered; the message lists the
                known ones.
        """
        self._load_entry_points()
        with self._lock:
            creator = self._creators.get(params.backend)
            known = sorted(self._creators)
        if creator is None:
            raise ValueError(
                f"the rendezvous backend {params.backend!r} is not registered; "
                f"known backends: {', '.join(known) or '(none)'}. Did you forget to install "
                "or import the package that provides it?"
            )
        return creator(params)


rendezvous_handler_registry = RendezvousHandlerRegistry()
for _name, _path in _BUILTIN.items():
    rendezvous_handler_registry.register(_name, _lazy(_path), origin=f"built-in ({_path})")


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build a rendezvous handler from the global registry.

    Args:
        params: The rendezvous parameters; ``params.backend`` picks the backend.

    Returns:
        A new handler.

    Raises:
        ValueError: The backend is not registered.
    """
    return rendezvous_handler_registry.create_handler(params)
