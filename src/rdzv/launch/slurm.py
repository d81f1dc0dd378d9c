"""What ``rdzv run`` takes from SLURM: node count, node rank, job id and the head node.

Inside a SLURM allocation (``srun rdzv run ...``, one task per node) the
job is described by ``SLURM_*`` variables. :func:`slurm_settings` turns
them into the values of ``--nnodes`` (``SLURM_NNODES``), ``--node-rank``
(``SLURM_NODEID``), ``--rdzv-id`` (``SLURM_JOB_ID``) and
``--rdzv-endpoint`` (the first host of ``SLURM_JOB_NODELIST`` on port
29400); ``rdzv run`` uses each only when the option was given neither on
the command line nor as a ``PET_*`` variable. :func:`expand_nodelist`
reads SLURM's compressed host lists (``node[01-04,07],gpu[1-2]-ib``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

__all__ = ["DEFAULT_PORT", "expand_nodelist", "slurm_settings"]

#: The port of the endpoint made from the head node.
DEFAULT_PORT = 29400

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_MAX_HOSTS = 1 << 20


def _split_top(text: str, name: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{name}={text!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{name}={text!r}: a ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{name}={text!r}: a '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, text: str, name: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"{name}={text!r}: {item!r} is not a number or a range A-B")
        first, last = match.group(1), match.group(2) or match.group(1)
        low, high = int(first), int(last)
        if high < low or high - low >= _MAX_HOSTS:
            raise ValueError(f"{name}={text!r}: the range {item!r} is not A-B with A <= B")
        width = len(first) if first.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    return values


def expand_nodelist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a SLURM host list into host names, in order.

    ``node[01-03,07]`` is node01, node02, node03, node07 (zero padding kept);
    a name may hold several bracket groups (``r[1-2]n[1-2]``: r1n1, r1n2,
    r2n1, r2n2); commas outside brackets separate names.

    Raises:
        ValueError: The list is empty or malformed; the message names ``name``.
    """
    hosts: list[str] = []
    for part in _split_top(text.strip(), name):
        if not part:
            raise ValueError(f"{name}={text!r}: an empty host name")
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [
            _expand_range(piece, text, name) if i % 2 else [piece] for i, piece in enumerate(pieces)
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def slurm_settings(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Return the ``rdzv run`` settings SLURM's variables give, with their source.

    Returns:
        ``{dest: (value, variable)}`` for ``nnodes``, ``node_rank``,
        ``rdzv_id`` and ``rdzv_endpoint``, as far as the variables are set
        (nothing outside SLURM).

    Raises:
        ValueError: A variable has a bad value; the message names it.
    """
    found: dict[str, tuple[str, str]] = {}
    for dest, names in (
        ("nnodes", ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")),
        ("node_rank", ("SLURM_NODEID",)),
        ("rdzv_id", ("SLURM_JOB_ID", "SLURM_JOBID")),
    ):
        hit = _first(environ, *names)
        if hit is None:
            continue
        name, value = hit
        if dest != "rdzv_id" and not (value.isascii() and value.isdigit()):
            raise ValueError(f"{name}={value!r} is not a non-negative integer")
        found[dest] = (value, name)
    hit = _first(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if hit is not None:
        name, value = hit
        head = expand_nodelist(value, name)[0]
        found["rdzv_endpoint"] = (f"{head}:{DEFAULT_PORT}", name)
    return found
