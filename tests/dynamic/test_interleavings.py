"""Random interleavings of joins, crashes, closes, heartbeats, clock skew and re-joins.

Nodes run the real machine (``decide``/``observe``/``plan_seal``/``judge_marks``)
against the real in-memory backend, one step at a time, in an order
hypothesis picks. Each node reads its own monotonic clock, offset from the
others by up to days (skew). After every step the invariants are checked:

* consistency: every node that completed round r saw the same participants,
  and its rank is its index in them;
* exclusivity: a live node runs an older round than the stored one only if
  it was evicted from that round (so at most one group is in force);
* liveness judgement: a node is evicted only if it had not beaten for the
  dead-node timeout of real time, whatever the clocks say.

A fair schedule at the end checks progress: every live node then runs the
current round, or waits as a spare behind a full round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.dynamic.judging import MarkWatch, SealJudging, judge_marks
from rdzv.dynamic.machine import (
    Complete,
    Enqueue,
    Fail,
    JoinProgress,
    Limits,
    Requeue,
    Seal,
    decide,
    leaving_members,
    missing_members,
    nodes_waiting,
    observe,
    plan_seal,
    start_join,
    successor_of,
)
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    decode_record,
    decode_state,
    encode_record,
    encode_state,
    make_node_key,
)
from rdzv.testing import FakeClock, InMemoryBackend

DEAD = 3.0
INTERVAL = DEAD / 3
LIMITS = Limits(min_nodes=2, max_nodes=3, join_timeout=60.0, last_call=5.0, grace=DEAD)
SKEWS = st.sampled_from([0.0, 3600.0, -3600.0, 86_400.0 * 3, -0.5])


@dataclass
class SimNode:
    key: str
    skew: float
    progress: JoinProgress | None = None  # None: running (or not started)
    round: int | None = None  # the round it completed last
    view: RendezvousState | None = None  # that round, as it knows it
    crashed: bool = False
    done: bool = False
    ring_watches: dict[str, MarkWatch] = field(default_factory=dict)
    seal_watches: dict[str, MarkWatch] = field(default_factory=dict)
    seal_judging: SealJudging = field(default_factory=SealJudging)
    missing: list[str] = field(default_factory=list)
    topology: str = ""  # its rank-order key value


class World:
    def __init__(self, limits: Limits = LIMITS, topologies: tuple[str, ...] = ()) -> None:
        self.limits = limits
        self.topologies = topologies  # the key values new nodes publish, in turn
        self.clock = FakeClock()
        self.backend = InMemoryBackend()
        self.nodes: list[SimNode] = []
        self.seen: dict[int, tuple[str, ...]] = {}
        self.last_beat: dict[str, float] = {}
        self.evicted: dict[int, set[str]] = {}

    def now(self, node: SimNode) -> float:
        return self.clock() + node.skew

    def read(self) -> tuple[RendezvousState | None, object]:
        found = self.backend.get_state()
        return (None, None) if found is None else (decode_state(found[0]), found[1])

    def spawn(self, skew: float) -> None:
        node = SimNode(make_node_key(f"node{len(self.nodes)}", 1, "x"), skew)
        if self.topologies:
            node.topology = self.topologies[len(self.nodes) % len(self.topologies)]
        self.nodes.append(node)
        self.start(node)

    def start(self, node: SimNode) -> None:
        state, _ = self.read()
        node.progress = start_join(state, self.now(node))
        node.missing = []

    def beat(self, node: SimNode) -> None:
        if not node.crashed and not node.done:
            self.backend.beat(node.key)
            self.last_beat[node.key] = self.clock()

    def evict(self, observer: SimNode, dead: list[str], round_id: int) -> None:
        for victim in dead:
            since = self.clock() - self.last_beat.get(victim, -math.inf)
            assert since >= DEAD, f"{victim} beat {since:.2f} s ago and was judged dead"
        state, token = self.read()
        members = [] if state is None else leaving_members(state, round_id, dead, False)
        if members:
            assert state is not None  # members come from a state
            result = self.backend.set_state(encode_state(state.evict(members)), token)
            if result is not None and result[2]:
                self.evicted.setdefault(round_id, set()).update(members)

    def watch_ring(self, node: SimNode) -> None:
        if node.crashed or node.done or node.view is None:
            return
        successor = successor_of(node.view, node.key)
        if successor is None:
            return
        marks = {successor: self.backend.heartbeat_mark(successor)}
        node.ring_watches, dead = judge_marks(node.ring_watches, marks, self.now(node), DEAD)
        if dead:
            self.evict(node, dead, node.view.round)
            node.view = node.view.evict(dead)

    def step(self, node: SimNode) -> None:
        if node.crashed or node.done or node.progress is None:
            return
        state, token = self.read()
        progress = node.progress
        length = self.backend.queue_length(progress.round_id)
        now = self.now(node)
        due = False
        if progress.blocked is not None and node.missing and state is not None:
            # The handler's own schedule: leaders often, others once the seal stalled.
            due, node.seal_judging = node.seal_judging.due(
                progress.position, self.limits, now, INTERVAL
            )
        if due and state is not None:
            marks = self.backend.heartbeat_marks(node.missing)
            node.seal_watches, dead = judge_marks(node.seal_watches, marks, now, DEAD)
            if dead:
                self.evict(node, dead, state.round)
                state, token = self.read()
        progress = observe(progress, state, length, self.limits, now)
        action = decide(progress, state, length, node.key, self.limits, now)
        if isinstance(action, Enqueue):
            record = encode_record(JoinRecord(node.key, topology=node.topology))
            progress = replace(progress, position=self.backend.enqueue(action.round_id, record))
        elif isinstance(action, Requeue):
            progress = JoinProgress(action.round_id, progress.started_at)
            node.seal_judging = SealJudging()
        elif isinstance(action, Seal):
            records = [decode_record(r) for r in self.backend.queue_records(progress.round_id)]
            plan = plan_seal(state, progress.round_id, records, self.limits)
            if plan is None:
                progress = replace(progress, blocked=(length, state))
                node.missing = missing_members(state, records)
            else:
                self.backend.set_state(encode_state(plan), token)
        elif isinstance(action, Complete):
            assert state is not None
            assert state.participants[action.rank] == node.key
            previous = self.seen.setdefault(state.round, state.participants)
            assert previous == state.participants, "two views of one round"
            node.round, node.view, node.progress = state.round, state, None
            node.ring_watches = {}
            return
        elif isinstance(action, Fail):
            node.done, node.progress = True, None
            return
        node.progress = progress

    def poll(self, node: SimNode) -> None:
        """What an agent does while it runs: re-join when nodes wait."""
        if node.crashed or node.done or node.progress is not None or node.round is None:
            return
        state, _ = self.read()
        if state is None:
            return
        length = self.backend.queue_length(state.next_round)
        queued = [decode_record(r) for r in self.backend.queue_records(state.next_round)]
        if nodes_waiting(state, length, node.key, self.limits, queued) > 0:
            self.start(node)

    def close(self) -> None:
        state, token = self.read()
        if state is None:
            self.backend.set_state(encode_state(RendezvousState().close()), None)
        elif not state.closed:
            self.backend.set_state(encode_state(state.close()), token)

    def check(self) -> None:
        state, _ = self.read()
        for n in self.nodes:
            running = not n.crashed and not n.done and n.progress is None and n.round is not None
            if running and state is not None and n.round != state.round:
                assert n.round is not None  # running
                assert n.key in self.evicted.get(n.round, set()), (
                    f"{n.key} still runs round {n.round} while round {state.round} is in force"
                )


OPS = st.sampled_from(
    [
        *("step", "step", "step", "beat", "beat", "watch", "poll"),
        *("spawn", "crash", "rejoin", "tick", "close"),
    ]
)


def play(world: World, ops: list[tuple[str, int, float]]) -> None:
    """Apply ``ops`` to ``world``, checking the invariants after each."""
    for op, arg, skew in ops:
        nodes = world.nodes
        target = nodes[arg % len(nodes)]
        if op == "step":
            world.step(target)
        elif op == "beat":
            world.beat(target)
        elif op == "watch":
            world.watch_ring(target)
        elif op == "poll":
            world.poll(target)
        elif op == "spawn" and len(nodes) < 7:
            world.spawn(skew)
        elif op == "crash":
            target.crashed = True
        elif op == "rejoin" and target.progress is None and not target.crashed and not target.done:
            world.start(target)
        elif op == "tick":
            world.clock.advance(arg / 2 + 0.25)
        elif op == "close" and arg == 0:
            world.close()
        world.check()


def settle(world: World) -> None:
    """A fair schedule: every live node beats, watches, polls and steps every 0.5 s.

    For longer than the join timeout.
    """
    for _ in range(150):
        for node in world.nodes:
            world.beat(node)
        for node in world.nodes:
            world.watch_ring(node)
            world.poll(node)
            world.step(node)
            world.check()
        world.clock.advance(0.5)


@settings(deadline=None)  # examples: the profile's (tests/conftest.py), 100 by default
@given(
    st.lists(SKEWS, min_size=2, max_size=2),
    st.lists(st.tuples(OPS, st.integers(0, 7), SKEWS), min_size=1, max_size=150),
)
def test_random_interleavings_keep_consistency_and_exclusivity(
    first_skews: list[float], ops: list[tuple[str, int, float]]
) -> None:
    world = World()
    for skew in first_skews:
        world.spawn(skew)
    play(world, ops)
    settle(world)
    state, _ = world.read()
    for node in world.nodes:
        if node.crashed or node.done:
            continue
        assert state is not None
        if node.progress is not None:
            assert len(state.live_participants()) >= LIMITS.max_nodes, "a live node is stuck"
        elif not state.closed:
            assert node.round == state.round, "a live node runs an old round"
