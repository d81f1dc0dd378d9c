"""The key layout of ``rdzv.keys`` finds the runs its writers leave in a store."""

from __future__ import annotations

import ast
from pathlib import Path

import rdzv
from rdzv.backends.kv import StoreJoinQueue, StoreLiveness
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.keys import agent_key, handler_prefix, round_store_prefix, run_of_backend_key
from rdzv.status import list_runs
from rdzv.store.memory import HashStore, PrefixStore


def test_list_runs_finds_each_run_by_any_key_the_c10d_backend_writes() -> None:
    store = HashStore()
    C10dRendezvousBackend(store, "by-state").set_state(b"state", None)
    C10dRendezvousBackend(store, "by-queue").enqueue(3, b"node 0")
    C10dRendezvousBackend(store, "by-beat").beat("host_1_ab")
    # The handler's keys and a round's store name runs only the backend knows.
    StoreJoinQueue(store, handler_prefix("handler-only")).enqueue(0, b"node 0")
    StoreLiveness(store, handler_prefix("handler-only")).beat("host_1_ab")
    PrefixStore(round_store_prefix("round-only", 0), store).set(agent_key(0), "{}")
    assert list_runs(store) == ["by-beat", "by-queue", "by-state"]


def test_only_a_backend_mark_names_a_run_and_its_id_may_hold_slashes() -> None:
    assert run_of_backend_key("rdzv.backend/a/b/q/0/n") == "a/b"
    assert run_of_backend_key("rdzv.backend/a/seat/x") is None
    assert run_of_backend_key("rdzv.handler/a/state") is None


# The roots of a run's keys, and the fragments the handler keeps under its root.
_ROOTS = ("rdzv.backend/", "rdzv.handler/", "rdzv.static/", "rdzv.launch/")
_FRAGMENTS = ("round/", "leave/", "confirm/", "/verdict", "seat/", "hb/")


def test_key_roots_and_the_handlers_key_fragments_are_spelled_in_rdzv_keys_only() -> None:
    # Prose (docstrings) may name them; code builds them with rdzv.keys. The
    # etcd and Redis backends lay out keys of their own under their engine's
    # prefix (documented in their modules), which no other module reads.
    src = Path(rdzv.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        name = path.relative_to(src).as_posix()
        if name == "keys.py" or name.startswith(("backends/etcd", "backends/redis")):
            continue
        tree = ast.parse(path.read_text())
        prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if id(node) not in prose and (
                    text.startswith("rdzv/") or any(f in text for f in _ROOTS + _FRAGMENTS)
                ):
                    found.append(f"{name}:{node.lineno}: {text!r}")
    assert found == []
