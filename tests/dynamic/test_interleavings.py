"""Random interleavings of joins, crashes, closes, heartbeats and re-joins.

Nodes run the real machine (``decide``/``observe``/``plan_seal``) against the
real in-memory backend, one step at a time, in an order hypothesis picks.
After every step the invariants are checked:

* consistency: every node that completed round r saw the same participants,
  and its rank is its index in them;
* exclusivity: nodes that are running (completed and not re-joining) and
  alive all run the same round.
"""

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.dynamic.machine import (
    Complete,
    Enqueue,
    Fail,
    JoinProgress,
    Limits,
    Requeue,
    Seal,
    decide,
    observe,
    plan_seal,
    start_join,
)
from rdzv.dynamic.state import (
    JoinRecord,
    decode_record,
    decode_state,
    encode_record,
    encode_state,
    make_node_key,
)
from rdzv.testing import FakeClock, InMemoryBackend

LIMITS = Limits(min_nodes=2, max_nodes=3, join_timeout=60.0, last_call=5.0, grace=3.0)


@dataclass
class SimNode:
    key: str
    progress: JoinProgress | None = None  # None: running (or not started)
    round: int | None = None  # the round it runs, once completed
    crashed: bool = False
    done: bool = False


class World:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.backend = InMemoryBackend()
        self.nodes: list[SimNode] = []
        self.seen: dict[int, tuple[str, ...]] = {}

    def read(self):  # type: ignore[no-untyped-def]
        found = self.backend.get_state()
        return (None, None) if found is None else (decode_state(found[0]), found[1])

    def spawn(self) -> None:
        node = SimNode(make_node_key(f"node{len(self.nodes)}", 1, "x"))
        self.nodes.append(node)
        self.start(node)

    def start(self, node: SimNode) -> None:
        state, _ = self.read()
        node.progress = start_join(state, self.clock())

    def step(self, node: SimNode) -> None:
        if node.crashed or node.done or node.progress is None:
            return
        state, token = self.read()
        progress = node.progress
        length = self.backend.queue_length(progress.round_id)
        now = self.clock()
        progress = observe(progress, state, length, LIMITS, now)
        action = decide(progress, state, length, node.key, LIMITS, now)
        if isinstance(action, Enqueue):
            position = self.backend.enqueue(action.round_id, encode_record(JoinRecord(node.key)))
            progress = replace(progress, position=position)
        elif isinstance(action, Requeue):
            progress = JoinProgress(action.round_id, progress.started_at)
        elif isinstance(action, Seal):
            records = [decode_record(r) for r in self.backend.queue_records(progress.round_id)]
            plan = plan_seal(state, progress.round_id, records, LIMITS)
            if plan is None:
                progress = replace(progress, blocked=(length, state))
            else:
                self.backend.set_state(encode_state(plan), token)
        elif isinstance(action, Complete):
            assert state is not None
            assert state.participants[action.rank] == node.key
            previous = self.seen.setdefault(state.round, state.participants)
            assert previous == state.participants, "two views of one round"
            node.round = state.round
            node.progress = None
            return
        elif isinstance(action, Fail):
            node.done = True
            node.progress = None
            return
        node.progress = progress

    def evict_crashed(self) -> None:
        state, token = self.read()
        if state is None or state.closed:
            return
        dead = [n.key for n in self.nodes if n.crashed and state.rank_of(n.key) is not None]
        if dead:
            self.backend.set_state(encode_state(state.evict(dead)), token)

    def close(self) -> None:
        state, token = self.read()
        if state is None:
            from rdzv.dynamic.state import RendezvousState

            self.backend.set_state(encode_state(RendezvousState().close()), None)
        elif not state.closed:
            self.backend.set_state(encode_state(state.close()), token)

    def check(self) -> None:
        running = {
            n.round
            for n in self.nodes
            if not n.crashed and not n.done and n.progress is None and n.round is not None
        }
        assert len(running) <= 1, f"two groups run at once: rounds {running}"


OPS = st.sampled_from(
    ["step", "step", "step", "spawn", "crash", "rejoin", "tick", "evict", "close"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(OPS, st.integers(0, 7)), min_size=1, max_size=120))
def test_random_interleavings_keep_consistency_and_exclusivity(
    ops: list[tuple[str, int]],
) -> None:
    world = World()
    for _ in range(2):
        world.spawn()
    for op, arg in ops:
        nodes = world.nodes
        target = nodes[arg % len(nodes)]
        if op == "step":
            world.step(target)
        elif op == "spawn" and len(nodes) < 7:
            world.spawn()
        elif op == "crash":
            target.crashed = True
        elif op == "rejoin" and target.progress is None and not target.crashed and not target.done:
            world.start(target)
        elif op == "tick":
            world.clock.advance(arg + 0.5)
        elif op == "evict":
            world.evict_crashed()
        elif op == "close" and arg == 0:
            world.close()
        world.check()
    # Liveness under a fair schedule: with everyone stepping and time passing
    # beyond the join timeout, every live node still joining must be a spare
    # waiting behind a full round (the only indefinite wait).
    for _ in range(70):
        world.evict_crashed()
        for node in world.nodes:
            world.step(node)
        world.clock.advance(1.0)
        world.check()
    state, _ = world.read()
    for node in world.nodes:
        if node.progress is not None and not node.crashed:
            assert state is not None
            assert len(state.live_participants()) >= LIMITS.max_nodes, node
