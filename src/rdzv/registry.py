"""The assembly point: backend names to backend factories and handler creators.

This module sits above the core (``rdzv.dynamic``) and the backends, and is
the only place that joins them. Two tables, both of ``module:function``
paths imported only when used:

* ``BACKEND_FACTORIES``: name -> backend factory ``(params) -> (backend,
  store)``, one per built-in engine (``c10d`` and its aliases, ``etcd``,
  ``redis``). Every dynamic backend is served by one generic creator,
  :func:`create_dynamic_handler`: the factory builds the backend and store,
  :func:`rdzv.dynamic.handler.create_handler` builds the handler on them.
* ``_BUILTIN``: name -> handler creator, for the handlers that are not
  dynamic (``static``).

Like torch's registry, :meth:`RendezvousHandlerRegistry.create_handler`
checks what a creator built: a handler whose ``get_backend()`` names another
backend is a ``RuntimeError``. An alias and its canonical name
(:data:`BACKEND_ALIASES`: ``p10d``/``core``/``tcp`` are ``c10d``;
``etcd``/``etcd-v2`` are ``etcd-v3``, the name rdzv's etcd backend reports)
count as the same backend.

Backends from other packages register a handler creator through the
entry-point group ``rdzv.handlers``: each entry point names a creator
``(RendezvousParameters) -> RendezvousHandler``. Entry points are loaded once,
lazily, the first time a name is looked up; one that fails to load produces
a warning, not a crash. :func:`open_backend` opens any of them as an
observer (``rdzv status``): a built-in through its factory, a plugin through
its handler when that is a dynamic handler.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING

from rdzv.api import RendezvousHandler, RendezvousParameters
from rdzv.errors import with_detail

if TYPE_CHECKING:
    from rdzv.backends.base import RendezvousBackend
    from rdzv.store.base import Store

__all__ = [
    "BACKEND_ALIASES",
    "BACKEND_FACTORIES",
    "ENTRY_POINT_GROUP",
    "BackendFactory",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "canonical_backend_name",
    "create_dynamic_handler",
    "create_handler",
    "get_registry",
    "get_rendezvous_handler",
    "open_backend",
    "rendezvous_handler_registry",
]

ENTRY_POINT_GROUP = "rdzv.handlers"

LOGGER = logging.getLogger("rdzv.registry")

RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]

BackendFactory = Callable[[RendezvousParameters], "tuple[RendezvousBackend, Store]"]

#: name -> "module:function" of the factory building ``(backend, store)``.
BACKEND_FACTORIES: dict[str, str] = {
    **dict.fromkeys(("c10d", "p10d", "core", "tcp"), "rdzv.backends.store:create_backend"),
    **dict.fromkeys(("etcd", "etcd-v2"), "rdzv.backends.etcd:create_backend"),
    "redis": "rdzv.backends.redis:create_backend",
}

#: alias -> the canonical name of the same backend (what its handler reports).
BACKEND_ALIASES: dict[str, str] = {
    **dict.fromkeys(("p10d", "core", "tcp"), "c10d"),
    **dict.fromkeys(("etcd", "etcd-v2"), "etcd-v3"),
}


def canonical_backend_name(name: str) -> str:
    """Return the canonical name of a backend (``p10d`` -> ``c10d``, ``etcd`` -> ``etcd-v3``).

    A name without alias is returned unchanged.
    """
    return BACKEND_ALIASES.get(name, name)


# name -> "module:function" of a handler creator that is not a dynamic backend's.
_BUILTIN: dict[str, str] = {"static": "rdzv.static:create_rdzv_handler"}


def _load(path: str) -> Callable[..., object]:
    module_name, _, function_name = path.partition(":")
    loaded: Callable[..., object] = getattr(importlib.import_module(module_name), function_name)
    return loaded


def _lazy(path: str) -> RendezvousHandlerCreator:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        creator: RendezvousHandlerCreator = _load(path)  # type: ignore[assignment]
        return creator(params)

    create.__qualname__ = create.__name__ = f"lazy[{path}]"
    return create


def _factory(name: str) -> BackendFactory:
    factory: BackendFactory = _load(BACKEND_FACTORIES[name])  # type: ignore[assignment]
    return factory


def create_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build a dynamic rendezvous handler on the built-in backend ``params.backend``.

    The backend's factory builds the backend and its store from ``params``;
    :func:`rdzv.dynamic.handler.create_handler` builds the handler on them.
    The handler owns both (its ``close()`` closes them); if building the
    handler fails, they are closed here.

    ``params.backend`` is a key of :data:`BACKEND_FACTORIES`.

    Raises:
        ValueError: A parameter is invalid; the message names it.
        RendezvousConnectionError: The backend could not be reached or hosted.
    """
    from rdzv.dynamic.admission_options import admission_from_params  # noqa: PLC0415 - lazy
    from rdzv.dynamic.handler import create_handler as create_on  # noqa: PLC0415 - lazy

    # Bad admission keys fail before anything connects.
    admission = admission_from_params(params, os.environ)
    backend, store = _factory(params.backend)(params)
    try:
        return create_on(store, backend, params, admission)
    except BaseException:
        try:
            backend.close()
        finally:
            store.close()
        raise


class RendezvousHandlerRegistry:
    """Maps backend names to creators of rendezvous handlers."""

    def __init__(self, load_entry_points: bool = True) -> None:
        """Create an empty registry that loads the ``rdzv.handlers`` entry points when told.

        They are loaded the first time a name is looked up.
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
            raise ValueError(
                f"The rendezvous backend name must be a non-empty string. Got {backend!r}."
            )
        with self._lock:
            current = self._creators.get(backend)
            if current is not None:
                if current is creator:
                    return
                raise with_detail(
                    ValueError(
                        f"The rendezvous backend '{backend}' cannot be registered with "
                        f"'{creator}' as it is already registered with '{current}'."
                    ),
                    f"It came from {self._origins[backend]}.",
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
        """Return every registered backend name with where it came from, sorted by name."""
        self._load_entry_points()
        with self._lock:
            return dict(sorted(self._origins.items()))

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Build the handler for ``params.backend``.

        Raises:
            ValueError: The backend is not registered; the message lists the
                known ones.
            RuntimeError: The handler built reports another backend
                (``get_backend()``; aliases count as their canonical name);
                the handler is closed.
        """
        self._load_entry_points()
        with self._lock:
            creator = self._creators.get(params.backend)
            known = sorted(self._creators)
        if creator is None:
            raise with_detail(
                ValueError(
                    f"The rendezvous backend '{params.backend}' is not registered. Did you "
                    "forget to call `register`?"
                ),
                f"Known backends: {', '.join(known) or '(none)'}; a backend from another "
                "package is registered when that package is installed.",
            )
        handler = creator(params)
        built = handler.get_backend()
        if canonical_backend_name(built) != canonical_backend_name(params.backend):
            _close_built(handler)
            raise with_detail(
                RuntimeError(
                    f"The rendezvous backend '{built}' does not match the requested backend "
                    f"'{params.backend}'."
                ),
                f"The creator registered under '{params.backend}' is {creator!r}; it built "
                f"a {type(handler).__name__}, which was closed.",
            )
        return handler


def _close_built(handler: RendezvousHandler) -> None:
    """Release a handler that will not be returned (its backend and store)."""
    close = getattr(handler, "close", None)
    try:
        if callable(close):
            close()
        else:
            handler.shutdown()
    except Exception:  # the mismatch is the error to raise; this one is logged
        LOGGER.warning(
            "could not close the %s handler built", type(handler).__name__, exc_info=True
        )


rendezvous_handler_registry = RendezvousHandlerRegistry()
for _name, _path in _BUILTIN.items():
    rendezvous_handler_registry.register(_name, _lazy(_path), origin=f"built-in ({_path})")
for _name, _path in BACKEND_FACTORIES.items():
    rendezvous_handler_registry.register(
        _name, create_dynamic_handler, origin=f"built-in (dynamic on {_path})"
    )


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build a rendezvous handler from the global registry.

    Raises:
        ValueError: The backend is not registered.
        RuntimeError: The handler built reports another backend.
    """
    return rendezvous_handler_registry.create_handler(params)


def get_registry() -> RendezvousHandlerRegistry:
    """Return the global registry, :data:`rendezvous_handler_registry` (the tensorplay spec's name)."""
    return rendezvous_handler_registry


get_rendezvous_handler = create_handler
"""torch's name of :func:`create_handler` (``registry.get_rendezvous_handler``)."""


def open_backend(
    params: RendezvousParameters, registry: RendezvousHandlerRegistry | None = None
) -> tuple[RendezvousBackend, Store]:
    """Open a run's backend and store as an observer, without joining.

    A built-in backend is opened through its factory. Any other name is
    built through the registry (so plugin backends registered through
    ``rdzv.handlers`` work too), and its handler's backend and store are
    used; that needs a :class:`~rdzv.dynamic.handler.DynamicRendezvousHandler`.

    Args:
        params: The parameters; ``params.backend`` names the backend.
            Callers that must not host a store set ``is_host=false``.
        registry: Where plugin backends are looked up (the global registry
            by default).

    Returns ``(backend, store)``; close both when done.

    Raises:
        ValueError: The backend is unknown, or its handler is not a dynamic
            rendezvous handler; the message names it.
        RendezvousConnectionError: The backend could not be reached.
    """
    if params.backend in BACKEND_FACTORIES:
        return _factory(params.backend)(params)
    from rdzv.dynamic.handler import DynamicRendezvousHandler  # noqa: PLC0415 - lazy

    handler = (registry or rendezvous_handler_registry).create_handler(params)
    if not isinstance(handler, DynamicRendezvousHandler):
        raise ValueError(  # noqa: TRY004 - a backend the user named, not an argument type
            f"the rendezvous backend {params.backend!r} builds a {type(handler).__name__}, "
            "not a dynamic rendezvous handler, so its state cannot be read"
        )
    return handler.backend, handler.store
