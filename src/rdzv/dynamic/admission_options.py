"""The admission rules' configuration keys, parsed once where a handler is built.

``--rdzv-conf`` (``RendezvousParameters.config``) keys: ``target_nodes`` (a
number, or ``slurm`` for ``$SLURM_NNODES``), ``node_multiple``,
``keep_ranks``, ``rank_order_key`` (an environment variable's name; this
node publishes its value) and ``segment_size``. Rules:
:mod:`rdzv.dynamic.admission`. Every bad value is a ``ValueError`` naming
its key, raised here, before anything connects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rdzv.api import RendezvousParameters
from rdzv.dynamic.admission import Admission
from rdzv.dynamic.state import is_topology_value

__all__ = ["ADMISSION_KEYS", "NodeAdmission", "admission_from_params", "shown_target"]

#: The configuration keys :func:`admission_from_params` reads.
ADMISSION_KEYS = frozenset(
    {"target_nodes", "node_multiple", "keep_ranks", "rank_order_key", "segment_size"}
)


@dataclass(frozen=True)
class NodeAdmission:
    """A run's admission rules and what this node publishes for them.

    Attributes:
        rules: The rules.
        topology: This node's value of ``rank_order_key``, or empty.
    """

    rules: Admission
    topology: str = ""


def _target(params: RendezvousParameters, environ: Mapping[str, str]) -> int | None:
    value = params.get("target_nodes")
    if isinstance(value, str) and value.strip().lower() == "slurm":
        text = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
        if not text or not text.strip().isdigit():
            raise ValueError(
                f"target_nodes=slurm: SLURM_NNODES is {text!r}, not a node count "
                "(is this node inside a SLURM allocation?)"
            )
        return int(text)
    return params.get_as_int("target_nodes")


def admission_from_params(
    params: RendezvousParameters, environ: Mapping[str, str]
) -> NodeAdmission:
    """Read the admission keys of ``params``; ``environ`` is this node's environment.

    Raises:
        ValueError: A value is invalid, the rules do not fit ``min_nodes``
            and ``max_nodes``, or the ``rank_order_key`` variable is not set
            to a publishable value; the message names the key.
    """
    key = params.get("rank_order_key")
    if key is not None and not isinstance(key, str):
        raise ValueError(f"rank_order_key must name an environment variable, got {key!r}")
    rules = Admission(
        target_nodes=_target(params, environ),
        node_multiple=params.get_as_int("node_multiple", 1) or 0,
        keep_ranks=bool(params.get_as_bool("keep_ranks", False)),
        rank_order_key=key.strip() if key else None,
        segment_size=params.get_as_int("segment_size"),
    )
    rules.bounds(params.min_nodes, params.max_nodes)
    if not rules.rank_order_key:
        return NodeAdmission(rules)
    value = environ.get(rules.rank_order_key, "")
    if not is_topology_value(value):
        raise ValueError(
            f"rank_order_key={rules.rank_order_key}: this node's value {value!r} is not "
            "1 to 256 printable ASCII characters without spaces"
        )
    return NodeAdmission(rules, value)


def shown_target(config: Mapping[str, str], environ: Mapping[str, str]) -> int | None:
    """Return the target size ``config`` names, for display; None when none or not readable."""
    params = RendezvousParameters("c10d", "localhost", "status", config=dict(config))
    try:
        return _target(params, environ)
    except ValueError:
        return None
