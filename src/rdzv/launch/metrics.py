"""The metrics of ``rdzv run --metrics-port``: one agent's rounds, restarts and heartbeats.

Every scrape reads the agent's :class:`~rdzv.launch.config.AgentStats` and,
for the dynamic rendezvous, the heartbeat marks of the current round's
members (one backend read per member, only when scraped). Heartbeats are
counters, not timestamps, so an age is the time on this machine's clock
since the mark was seen to change between scrapes; a member whose mark was
not yet seen to change has no sample.
"""

from __future__ import annotations

from collections.abc import Callable

from rdzv.api import RendezvousHandler
from rdzv.backends.base import LivenessBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import decode_state
from rdzv.errors import RendezvousError
from rdzv.launch.config import AgentStats
from rdzv.metrics import Family, Sample, counter, gauge
from rdzv.status import HeartbeatTracker

__all__ = ["agent_metrics"]


def _heartbeat_ages(handler: RendezvousHandler, tracker: HeartbeatTracker) -> list[Sample]:
    if not isinstance(handler, DynamicRendezvousHandler):
        return []
    backend = handler.backend
    if not isinstance(backend, LivenessBackend):
        return []
    try:
        found = backend.get_state()
        if found is None:
            return []
        state = decode_state(found[0])
        nodes = [n for r, n in enumerate(state.participants) if r not in state.evicted]
        for node in nodes:
            tracker.observe(node, backend.heartbeat_mark(node))
    except RendezvousError:
        return []
    ages = ((node, tracker.age(node)) for node in nodes)
    return [Sample(age, {"node": node}) for node, age in ages if age is not None]


def agent_metrics(
    stats: AgentStats, handler: RendezvousHandler, max_restarts: int
) -> Callable[[], list[Family]]:
    """Return the collect function of one agent's metrics endpoint."""
    tracker = HeartbeatTracker()
    run_id = handler.get_run_id()
    backend = handler.get_backend()

    def collect() -> list[Family]:
        join = Family(
            "rdzv_agent_join_seconds",
            "summary",
            "seconds spent in completed rendezvous calls",
            [Sample(stats.join_seconds_sum, suffix="_sum"), Sample(stats.rounds, suffix="_count")],
        )
        return [
            gauge(
                "rdzv_agent_info", "this agent's run and backend", 1, run_id=run_id, backend=backend
            ),
            counter(
                "rdzv_agent_rounds_total", "rendezvous rounds this node completed", stats.rounds
            ),
            counter(
                "rdzv_agent_reforms_total",
                "times the workers stopped for a change of the group (not restarts)",
                stats.reforms,
            ),
            gauge(
                "rdzv_agent_restarts",
                "restarts counted after worker failures (one given back when the group "
                "turned out to have changed is subtracted)",
                stats.restarts,
            ),
            gauge("rdzv_agent_max_restarts", "the restart budget (--max-restarts)", max_restarts),
            counter(
                "rdzv_agent_evictions_total",
                "members this node evicted after missed heartbeats",
                stats.evictions,
            ),
            join,
            gauge(
                "rdzv_agent_last_join_seconds",
                "seconds the last completed rendezvous call took",
                stats.join_seconds_last,
            ),
            gauge("rdzv_agent_workers", "workers running on this node", stats.workers),
            gauge("rdzv_agent_round_nodes", "nodes in the current round", stats.world_size),
            gauge("rdzv_agent_ready", "1 once a round has completed", int(stats.first_round)),
            Family(
                "rdzv_agent_heartbeat_age_seconds",
                "gauge",
                "seconds since each live member's heartbeat was seen to change (between scrapes)",
                _heartbeat_ages(handler, tracker),
            ),
        ]

    return collect
