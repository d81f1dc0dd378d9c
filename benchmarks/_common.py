"""What the benchmarks share: the checkout on ``sys.path``, the test helpers, handlers, :func:`stamp`.

Importing this module puts the checkout's ``src`` and root first on
``sys.path``, so a benchmark runs this tree's rdzv and can use the helpers
it shares with the tests, re-exported here: ``tests/procs.py`` (child
environments, free ports, bounded polling, a counting store, a process's
memory and CPU time), ``tests/store/hostile.py`` (raw attacker sockets and
frames, a quantile), ``tests/certs.py`` (TLS files) and ``stop_process``
of ``tests/engines/servers.py`` (whose private etcd and redis-server the
benchmarks import from there). :func:`make_handler` builds one agent's
handler of a benchmark column; :func:`release` starts waiting benchmark
processes together.

A figure means little without the load it was measured under: each
benchmark prints :func:`stamp` before its first measurement and after its
last, so a table pasted into the docs carries the load average beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.certs import make_tls_files  # noqa: E402 - after the path
from tests.engines.servers import stop_process  # noqa: E402 - after the path
from tests.procs import (  # noqa: E402 - after the path
    CountingStore,
    NotReachedError,
    cpu_seconds,
    free_port,
    read_markers,
    rss_bytes,
    subprocess_env,
    wait_until,
)
from tests.store.hostile import (  # noqa: E402 - after the path
    VALIDATE,
    attacker,
    quantile,
    send_quietly,
    slow_check_frame,
    waiting_attack,
)

__all__ = [
    "ROOT",
    "VALIDATE",
    "CountingStore",
    "NotReachedError",
    "attacker",
    "cpu_seconds",
    "free_port",
    "load",
    "make_handler",
    "make_tls_files",
    "quantile",
    "read_markers",
    "release",
    "rss_bytes",
    "send_quietly",
    "slow_check_frame",
    "waiting_attack",
    "stamp",
    "stop_process",
    "subprocess_env",
    "wait_until",
]


def load() -> str:
    """Return the load averages, the core count and the running/total threads."""
    with open("/proc/loadavg") as f:
        avg = f.read().split()
    return f"loadavg {' '.join(avg[:3])} on {os.cpu_count()} cores ({avg[3]} running/threads)"


def release(procs: Sequence[subprocess.Popen[str]], delay: float) -> float:
    """Tell each waiting benchmark process (a ``go START`` line on its stdin) to start in ``delay`` s.

    Returns the wall-clock start time they were given.
    """
    start_at = time.time() + delay
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"go {start_at}\n")
        proc.stdin.flush()
    return start_at


def stamp(when: str) -> None:
    """Print ``when``, the time of day and :func:`load` as one line."""
    print(f"{when}: {time.strftime('%H:%M:%S')} {load()}", flush=True)


def make_handler(
    impl: str, cfg: dict[str, Any], addr: str, count: Callable[[str, tuple[Any, ...], Any], None]
) -> Any:
    """Return one agent's handler of the column ``impl``, its TCP store calls told to ``count``.

    ``etcd`` and ``redis``: rdzv's handler from ``rdzv.create_handler`` on
    ``cfg["endpoint"]`` (not counted); ``rdzv``: rdzv's handler over its c10d
    backend on rdzv's TCP store at ``cfg["port"]``, its liveness on a second
    connection when ``cfg["two_clients"]``; otherwise torch's handler over
    torch's c10d backend and TCPStore (its backend's calls counted). ``cfg``
    also holds ``run_id``, ``min``, ``max``, ``join``, ``last_call``,
    ``interval``, ``attempts`` and the engines' ``read_timeout``, and may
    hold ``etcd_client`` (the etcd backend's ``client`` option).
    """
    run_id, n_min, n_max = cfg["run_id"], cfg["min"], cfg["max"]
    if impl in ("etcd", "redis"):
        import rdzv

        params = rdzv.RendezvousParameters(
            impl,
            cfg["endpoint"],
            run_id,
            n_min,
            n_max,
            local_addr=addr,
            join_timeout=cfg["join"],
            last_call_timeout=cfg["last_call"],
            keep_alive_interval=cfg["interval"],
            keep_alive_max_attempt=cfg["attempts"],
            read_timeout=cfg["read_timeout"],
            **({"client": cfg["etcd_client"]} if impl == "etcd" and "etcd_client" in cfg else {}),
        )
        return rdzv.create_handler(params)
    if impl == "rdzv":
        from rdzv.api import RendezvousTimeout
        from rdzv.backends.store import C10dRendezvousBackend
        from rdzv.dynamic.handler import DynamicRendezvousHandler
        from rdzv.store.tcp import TCPStore

        inner = TCPStore("127.0.0.1", cfg["port"], timeout=120)
        store: Any = CountingStore(inner, count)
        live: Any = CountingStore(inner.clone(), count) if cfg["two_clients"] else None
        backend = C10dRendezvousBackend(store, run_id, liveness_store=live)
        return DynamicRendezvousHandler.from_backend(
            run_id,
            store,
            backend,
            n_min,
            n_max,
            local_addr=addr,
            timeout=RendezvousTimeout(join=cfg["join"], last_call=cfg["last_call"]),
            keep_alive_interval=cfg["interval"],
            keep_alive_max_attempt=cfg["attempts"],
        )
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend as TorchBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler as TorchHandler,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousTimeout as TorchTimeout,
    )

    tstore = dist.TCPStore(
        "127.0.0.1",
        cfg["port"],
        is_master=False,
        timeout=timedelta(seconds=120),
        wait_for_workers=False,
    )
    return TorchHandler.from_backend(
        run_id,
        tstore,
        TorchBackend(CountingStore(tstore, count), run_id),  # type: ignore[arg-type]
        n_min,
        n_max,
        local_addr=addr,
        timeout=TorchTimeout(
            join=timedelta(seconds=cfg["join"]), last_call=timedelta(seconds=cfg["last_call"])
        ),
        keep_alive_interval=cfg["interval"],
        keep_alive_max_attempt=cfg["attempts"],
    )
