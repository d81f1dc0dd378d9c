"""The first failure of a round, recorded once for the whole job: an agent's side.

Theory of operation. When a worker fails, every agent of the job has
something to say: the one whose worker failed, and the others, whose
workers lose a peer or are stopped for the re-formation. What a person
needs is the cause, named once. So the agent that sees a failure records
it (:class:`~rdzv.first_failure.FailureRecord`) before it stops anything,
with a create-only write in the round's store
(:func:`~rdzv.first_failure.record_first`): across all agents exactly one
record per round wins, and every loser gets the winner back from the same
call. The winner copies it to the run-level key
(:func:`~rdzv.first_failure.publish_last`), outside every round's prefix,
so the record outlives the re-formation it causes: ``rdzv status`` shows
it and the next rounds' agents can read it. The winner writes both before
it re-joins, so an agent that sees it waiting to re-form finds the record
already there.

The lines an agent writes about a restart or a re-form, and its last line,
end with ``after the first failure: ...`` (:meth:`FirstFailure.after`),
unless the failure they describe is that first failure itself.

"First" is the first recorded: the failure some agent saw first, which on
unsynchronised monitors is not always the one that happened first (a peer's
worker that dies of the lost connection may be seen sooner), and an agent
that dies whole records nothing (its peers' failures are recorded instead).
A store that cannot be used, or a record that does not decode, costs a
note in the agent's log, never the agent.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from rdzv.api import RendezvousInfo
from rdzv.errors import RendezvousError
from rdzv.first_failure import (
    KIND_EXIT,
    KIND_HUNG,
    KIND_SIGNAL,
    FailureRecord,
    FailureRecordError,
    decode_failure,
    encode_failure,
    publish_last,
    record_first,
)
from rdzv.keys import first_failure_key, round_of_store
from rdzv.launch.exits import WorkerExit, signal_name
from rdzv.store.base import Store
from rdzv.store.foreign import as_store
from rdzv.store.memory import PrefixStore

__all__ = ["FirstFailure", "record_of"]


def record_of(
    failure: WorkerExit,
    *,
    host: str,
    when: float,
    kind: str | None = None,
    detail: str | None = None,
    stack: str | None = None,
    group_rank: int | None = None,
    node: str | None = None,
    round: int | None = None,
    restart: int = 0,
) -> FailureRecord:
    """Return the record of a worker's exit (the other arguments are the fields of those names).

    ``kind`` and ``detail`` default to what the exit tells: its code or
    signal and the root cause ``@record`` left, or for a worker the agent
    judged hung, :data:`~rdzv.first_failure.KIND_HUNG` and why (which
    names its stack file).
    """
    code = failure.returncode
    name = None
    if code < 0:
        name = signal_name(-code) or str(-code)
    if failure.hang is not None:
        # Judged hung and ended by this agent: its signal is the agent's.
        kind = kind or KIND_HUNG
        detail = detail if detail is not None else f"hung{failure.hang}"
    return FailureRecord(
        kind or (KIND_SIGNAL if name else KIND_EXIT),
        failure.rank,
        failure.local_rank,
        host,
        when,
        code if code >= 0 else None,
        name,
        detail if detail is not None else failure.root_cause,
        None if failure.log_path is None else str(failure.log_path),
        stack,
        group_rank,
        node,
        round,
        restart,
    )


class FirstFailure:
    """One agent's side of the first failures of its rounds.

    Args:
        run_id: The run.
        node: This agent's rendezvous node key, if it has one.
        log: Receives the notes (a store that failed, a record that did not
            decode) and the lines of :meth:`say`.
        host: This machine's name (``socket.gethostname()`` when None).
        clock: The wall clock of the records' times.
    """

    def __init__(
        self,
        run_id: str,
        node: str | None,
        log: Callable[[str], None],
        host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._run_id = run_id
        self._node = node
        self._log = log
        self._host = host or socket.gethostname()
        self._clock = clock
        self._store: Store | None = None
        self._where: tuple[int, int | None, int] = (0, None, 0)
        self._first: FailureRecord | None = None
        self._found = False
        self._own = False

    def round_started(self, info: RendezvousInfo, group_rank: int, restart: int) -> None:
        """Follow the round whose workers this agent starts now."""
        self._store = store = as_store(info.store)
        prefix = store.prefix if isinstance(store, PrefixStore) else ""
        self._where = (group_rank, round_of_store(self._run_id, prefix), restart)
        self._first, self._found, self._own = None, False, False

    def report(
        self,
        failure: WorkerExit,
        kind: str | None = None,
        detail: str | None = None,
        stack: str | None = None,
    ) -> FailureRecord | None:
        """Record a failure this agent saw, unless the round has its first; return the first.

        ``kind``, ``detail`` and ``stack`` override what the exit tells (a
        hung worker: :data:`~rdzv.first_failure.KIND_HUNG`, how long it made
        no progress, where its stacks are). None when the store could not be
        used or its record does not decode.
        """
        store = self._store
        if store is None or self._found:
            return self._first
        group_rank, round_id, restart = self._where
        record = record_of(
            failure,
            host=self._host,
            when=self._clock(),
            kind=kind,
            detail=detail,
            stack=stack,
            group_rank=group_rank,
            node=self._node,
            round=round_id,
            restart=restart,
        )
        mine = encode_failure(record)
        try:
            stored = record_first(store, record)
            self._own = stored == mine
            if self._own:
                run_store = store.underlying_store if isinstance(store, PrefixStore) else store
                publish_last(run_store, self._run_id, mine)
        except RendezvousError as exc:
            self._log(f"could not record the first failure: {type(exc).__name__}: {exc}")
            return None
        self._found = True
        self._first = record if self._own else self._decoded(stored)
        return self._first

    def first(self) -> FailureRecord | None:
        """Return the first failure of the round this agent follows, or None (read once found)."""
        if self._found or self._store is None:
            return self._first
        try:
            raw = self._store.try_multi_get([first_failure_key()])[0]
        except RendezvousError as exc:
            self._log(f"could not read the first failure: {type(exc).__name__}: {exc}")
            return None
        if raw is not None:
            self._found = True
            self._first = self._decoded(raw)
        return self._first

    def after(self, text: str) -> str:
        """Return ``text`` naming the round's first failure, unless this agent's report was it."""
        first = self.first()
        if first is None or self._own:
            return text
        return f"{text} after the first failure: {first.describe()}"

    def say(self, text: str) -> None:
        """Log ``text`` naming the round's first failure (see :meth:`after`)."""
        self._log(self.after(text))

    def _decoded(self, raw: bytes) -> FailureRecord | None:
        try:
            return decode_failure(raw)
        except FailureRecordError as exc:
            self._log(f"ignoring the round's first-failure record, which does not decode: {exc}")
            return None
