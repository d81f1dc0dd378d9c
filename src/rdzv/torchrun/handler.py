"""torch's ``RendezvousHandler`` over an rdzv handler, and rdzv's errors as torch's.

The handler class subclasses torch's, so it is defined lazily
(:func:`_handler_class`): importing this module does not import torch.

Workers never share the agent's store (``use_agent_store`` is False): the
agent of group rank 0 picks a free port each round, and the worker of global
rank 0 hosts a fresh store there, so a round never sees a former round's keys.

rdzv's errors become torch's errors of the same meaning (``raise ... from``),
so torch's agent reacts as it does to its own backends: rendezvous errors
through :func:`_torch_errors`, the store errors of the ``torch.distributed.Store``
adapter through :func:`rdzv.torch.dist_errors`. One exception: a spare's graceful exit.
torch 2.13's agent catches its ``RendezvousGracefulExitError`` and returns
None, on which torch's launcher then fails (``'NoneType' object has no
attribute 'is_failed'``, exit status 1); so by default (``spare_exit=exit0``)
the handler raises ``SystemExit(0)`` instead, which torch's agent and
launcher pass through after shutting down cleanly. ``spare_exit=raise``
raises torch's error.

``shutdown()`` closes the run only when the job finished (torch's exit
barrier of the current round completed), so spares exit gracefully; after a
failure it only leaves the round, and the other nodes may re-form without
this one (torch's own ``c10d`` backend closes the run in both cases).

torch's agent calls ``next_rendezvous()`` again when its workers failed or
nodes wait. rdzv's handler then first leaves the round it is a member of, so
the other members see it waiting (``num_nodes_waiting``) even when the round
is full, and restart to re-form with it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rdzv import errors
from rdzv.api import RendezvousHandler
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.torchrun.events import bridge_events

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store as TorchStore
    from torch.distributed.elastic.rendezvous import api as torch_api

    from rdzv.torchrun.server_child import _ServerProcess
    from rdzv.torchrun.stores import _RoundStores

LOGGER = logging.getLogger("rdzv.torchrun")

# torch's exit barrier (torch/distributed/elastic/agent/server/api.py and
# elastic/utils/store.py, torch 2.13): the last agent to arrive sets this key.
_EXIT_BARRIER_DONE_KEY = "torchelastic/agent/terminal_state/last_member"


@contextlib.contextmanager
def _torch_errors() -> Iterator[None]:
    """Re-raise rdzv's rendezvous errors as torch's errors of the same meaning."""
    from torch.distributed.elastic import rendezvous as tr  # noqa: PLC0415 - torch is optional

    try:
        yield
    except errors.RendezvousGracefulExitError as exc:
        raise tr.RendezvousGracefulExitError(str(exc)) from exc
    except errors.RendezvousClosedError as exc:
        raise tr.RendezvousClosedError(str(exc)) from exc
    except errors.RendezvousTimeoutError as exc:
        raise tr.RendezvousTimeoutError(str(exc)) from exc
    except errors.RendezvousConnectionError as exc:
        raise tr.RendezvousConnectionError(str(exc)) from exc
    except errors.RendezvousStateError as exc:
        raise tr.RendezvousStateError(str(exc)) from exc
    except errors.RendezvousError as exc:
        raise tr.RendezvousError(str(exc)) from exc


class _Resources:
    """What a handler owns besides the rdzv handler: clients and the server child."""

    def __init__(
        self,
        stores: _RoundStores,
        closers: tuple[Callable[[], None], ...] = (),
        server: _ServerProcess | None = None,
    ) -> None:
        self.stores = stores
        self.closers = closers
        self.server = server

    def close(self) -> None:
        self.stores.close()
        for close in self.closers:
            with contextlib.suppress(errors.RendezvousError, OSError):
                close()
        if self.server is not None:
            self.server.stop()
            self.server = None


@functools.cache
def _handler_class() -> type[torch_api.RendezvousHandler]:
    """Define the torch handler class (imports torch, so only on first use)."""
    import torch.distributed.elastic.rendezvous as tr  # noqa: PLC0415 - torch is optional

    class TorchrunRendezvousHandler(tr.RendezvousHandler):
        """torch's ``RendezvousHandler`` interface over an rdzv handler.

        Args:
            name: The name torchrun knows the backend by (``rdzv``, ...).
            inner: The rdzv handler.
            resources: The stores and server this handler owns.
            spare_exit: ``exit0`` or ``raise`` (see :func:`create_rdzv_handler`).
        """

        def __init__(
            self, name: str, inner: RendezvousHandler, resources: _Resources, spare_exit: str
        ) -> None:
            self._name = name
            self._spare_exit = spare_exit
            self._inner = inner
            self._resources = resources
            self._round_store: TorchStore | None = None
            self._shut_down = False

        @property
        def inner(self) -> RendezvousHandler:
            """The rdzv handler."""
            return self._inner

        def get_backend(self) -> str:
            return self._name

        @property
        def use_agent_store(self) -> bool:
            return False

        def next_rendezvous(self) -> tr.RendezvousInfo:
            self._resources.stores.release()
            self._round_store = None
            try:
                with _torch_errors():
                    info = self._inner.next_rendezvous()
                    store = self._resources.stores.round_store(info)
            except tr.RendezvousGracefulExitError as exc:
                if self._spare_exit == "raise":
                    raise
                LOGGER.warning("rdzv: %s; this agent is not needed and exits with status 0", exc)
                raise SystemExit(0) from exc
            self._round_store = store
            boot = info.bootstrap_store_info
            assert boot is not None  # rdzv's dynamic handler always builds it
            return tr.RendezvousInfo(
                store,
                info.rank,
                info.world_size,
                tr.RendezvousStoreInfo(boot.master_addr, boot.master_port),
            )

        def is_closed(self) -> bool:
            with _torch_errors():
                return self._inner.is_closed()

        def set_closed(self) -> None:
            with _torch_errors():
                self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            with _torch_errors():
                return self._inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self._inner.get_run_id()

        def _job_finished(self) -> bool:
            store = self._round_store
            if store is None:
                return False
            try:
                return bool(store.check([_EXIT_BARRIER_DONE_KEY]))
            except (RuntimeError, OSError):
                return False

        def shutdown(self) -> bool:
            if self._shut_down:
                return True
            self._shut_down = True
            if self._job_finished():
                try:
                    self.set_closed()
                except tr.RendezvousError as exc:
                    LOGGER.warning("rdzv could not close the finished run: %s", exc)
            self._round_store = None
            try:
                return self._inner.shutdown()
            finally:
                self._resources.close()

    return TorchrunRendezvousHandler


def _show_warnings() -> None:
    """Make the plugin's warnings reach stderr inside torchrun.

    rdzv's loggers have only a ``NullHandler`` (the application decides where
    logs go), and torchrun configures no handler for them, so the plugin,
    acting as torchrun's front-end here, shows its own warnings unless the
    application configured logging.
    """
    if LOGGER.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)


def _wrap(
    name: str, inner: RendezvousHandler, resources: _Resources, spare_exit: str
) -> torch_api.RendezvousHandler:
    _show_warnings()
    if isinstance(inner, DynamicRendezvousHandler):
        detach = bridge_events(inner.get_run_id(), inner.node)
        if detach is not None:
            resources.closers = (*resources.closers, detach)
    cls: Any = _handler_class()
    handler: torch_api.RendezvousHandler = cls(name, inner, resources, spare_exit)
    return handler
