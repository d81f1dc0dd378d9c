"""Global worker ranks and the torchrun-compatible worker environment.

After a round completes, every agent writes its role and local world size
under its group rank in the round's store and reads everyone's back (one
``set`` and one ``multi_get`` per agent, so the cost grows linearly with the
number of nodes). Workers are then numbered node after node in group-rank
order: node ``g``'s local rank ``l`` gets global rank
``sum(local world sizes of nodes < g) + l``. Role ranks count the same way
among the nodes that run the same role.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rdzv.api import RendezvousStoreInfo
from rdzv.errors import RendezvousStateError
from rdzv.keys import LAUNCH_ROOT
from rdzv.store.base import Store

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "NodeRanks",
    "assign_ranks",
    "visible_device",
    "worker_environment",
]


@dataclass(frozen=True)
class NodeRanks:
    """Where this node's workers sit in the whole job.

    Args:
        group_rank: This node's rank in the round.
        group_world_size: The number of nodes in the round.
        local_world_size: Workers on this node.
        base_rank: The global rank of this node's local rank 0.
        world_size: Workers in the whole job.
        role: This node's role name.
        role_base_rank: The role rank of this node's local rank 0.
        role_world_size: Workers in the job with this node's role.
    """

    group_rank: int
    group_world_size: int
    local_world_size: int
    base_rank: int
    world_size: int
    role: str
    role_base_rank: int
    role_world_size: int


def _decode_node(raw: bytes, group_rank: int) -> tuple[str, int]:
    try:
        data = json.loads(raw)
        role, nproc = data["role"], data["nproc"]
    except (ValueError, KeyError, TypeError):
        raise RendezvousStateError(
            f"the launcher record of node {group_rank} in the round's store is not valid: {raw!r}"
        ) from None
    if not isinstance(role, str) or isinstance(nproc, bool) or not isinstance(nproc, int):
        raise RendezvousStateError(
            f"the launcher record of node {group_rank} has bad types: {raw!r}"
        )
    if nproc < 1:
        raise RendezvousStateError(f"node {group_rank} reports {nproc} workers; expected >= 1")
    return role, nproc


def wait_for_keys(store: Store, keys: Sequence[str]) -> None:
    """Wait for keys up to the store's timeout (the default way to wait for peers).

    Args:
        store: The store.
        keys: The keys.
    """
    store.wait(keys)


def assign_ranks(
    store: Store,
    group_rank: int,
    group_world_size: int,
    local_world_size: int,
    role: str,
    wait: Callable[[Store, Sequence[str]], None] = wait_for_keys,
) -> NodeRanks:
    """Exchange local world sizes through the round's store and number the workers.

    Args:
        store: The round's store (fresh for every round).
        group_rank: This node's rank in the round.
        group_world_size: The number of nodes in the round.
        local_world_size: Workers on this node.
        role: This node's role.
        wait: Waits until the other nodes' records exist (it may give up by
            raising).

    Returns:
        This node's place in the job.

    Raises:
        RendezvousStateError: Another node's record does not decode.
        StoreTimeoutError: Some node did not write its record in time.
    """
    record = json.dumps({"role": role, "nproc": local_world_size})
    store.set(f"{LAUNCH_ROOT}/node/{group_rank}", record)
    keys = [f"{LAUNCH_ROOT}/node/{r}" for r in range(group_world_size)]
    wait(store, keys)
    raws = store.multi_get(keys)
    nodes = [_decode_node(raw, r) for r, raw in enumerate(raws)]
    base_rank = sum(n for _, n in nodes[:group_rank])
    role_base = sum(n for r, n in nodes[:group_rank] if r == role)
    return NodeRanks(
        group_rank=group_rank,
        group_world_size=group_world_size,
        local_world_size=local_world_size,
        base_rank=base_rank,
        world_size=sum(n for _, n in nodes),
        role=role,
        role_base_rank=role_base,
        role_world_size=sum(n for r, n in nodes if r == role),
    )


#: The signals torchrun handles by default (``--signals-to-handle``).
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def worker_environment(
    base: Mapping[str, str],
    ranks: NodeRanks,
    local_rank: int,
    master: RendezvousStoreInfo,
    restart_count: int,
    max_restarts: int,
    run_id: str,
    *,
    error_file: str | None = None,
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE,
    virtual_local_rank: bool = False,
) -> dict[str, str]:
    """Build one worker's environment, as torchrun would.

    ``OMP_NUM_THREADS=1`` (with several workers per node) and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` are set unless ``base`` already has
    them.

    Args:
        base: The environment to start from (usually the agent's).
        ranks: This node's place in the job.
        local_rank: The worker's rank on this node.
        master: The bootstrap store of this attempt.
        restart_count: Restarts after failures so far.
        max_restarts: The restart budget.
        run_id: The run identifier.
        error_file: ``TORCHELASTIC_ERROR_FILE``: where torch's ``@record``
            writes the worker's root cause (unset when None).
        signals_to_handle: ``TORCHELASTIC_SIGNALS_TO_HANDLE``, the signals
            the agent handles, comma-separated.
        virtual_local_rank: torchrun's ``--virtual-local-rank``: ``LOCAL_RANK``
            is 0 and ``CUDA_VISIBLE_DEVICES`` names only this worker's device
            (the ``local_rank``-th of ``base``'s list, or ``local_rank``).

    Returns:
        The complete environment.

    Raises:
        ValueError: ``virtual_local_rank`` and ``base``'s
            ``CUDA_VISIBLE_DEVICES`` lists fewer devices than ``local_rank + 1``.
    """
    env = dict(base)
    if ranks.local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(
        {
            "RANK": str(ranks.base_rank + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(ranks.world_size),
            "LOCAL_WORLD_SIZE": str(ranks.local_world_size),
            "GROUP_RANK": str(ranks.group_rank),
            "GROUP_WORLD_SIZE": str(ranks.group_world_size),
            "ROLE_NAME": ranks.role,
            "ROLE_RANK": str(ranks.role_base_rank + local_rank),
            "ROLE_WORLD_SIZE": str(ranks.role_world_size),
            "MASTER_ADDR": master.master_addr,
            "MASTER_PORT": str(master.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            # The agent hosts the workers' store: torch's env:// rendezvous then
            # connects to it as a client instead of binding MASTER_PORT itself.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": signals_to_handle,
        }
    )
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = visible_device(base, local_rank)
    return env


def visible_device(base: Mapping[str, str], local_rank: int) -> str:
    """Return the one device a worker sees under ``--virtual-local-rank``.

    Args:
        base: The agent's environment.
        local_rank: The worker's rank on this node.

    Returns:
        The ``local_rank``-th entry of ``CUDA_VISIBLE_DEVICES``, or
        ``local_rank`` when that is unset.

    Raises:
        ValueError: ``CUDA_VISIBLE_DEVICES`` lists too few devices.
    """
    visible = base.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank)
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise ValueError(
            f"local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return devices[local_rank].strip()
