"""How many workers one node starts: ``--nproc-per-node``, decided as torchrun decides it.

A number, or a name counted on this machine (``cpu``, ``gpu``, ``xpu``,
``auto``); then refused when it is more than the node may run: more than
:data:`NPROC_PER_CPU` workers per usable CPU (``RDZV_MAX_NPROC_PER_NODE``
sets another limit), or more processes than the kernel gives.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import resource
from types import ModuleType

from rdzv.launch.options import RunOptionsError

__all__ = ["MAX_NPROC_VARIABLE", "NPROC_PER_CPU", "local_world_size"]

#: The variable that sets the most workers one node starts (``--nproc-per-node``).
MAX_NPROC_VARIABLE = "RDZV_MAX_NPROC_PER_NODE"

#: Without :data:`MAX_NPROC_VARIABLE`, one node starts at most this many workers
#: per CPU it may use (and at least :data:`_NPROC_FLOOR` in all).
NPROC_PER_CPU = 32
_NPROC_FLOOR = 64


def _usable_cpus() -> int:
    # torch._utils.cpu_count: the CPUs this process may run on (cgroups, taskset).
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _torch() -> ModuleType | None:
    if importlib.util.find_spec("torch") is None:
        return None
    return importlib.import_module("torch")


def local_world_size(text: str) -> int:
    """Decide ``--nproc-per-node`` as torchrun does.

    ``cpu``: the CPUs this process may use. ``gpu``: the CUDA devices (an
    error without CUDA). ``xpu``: the XPU devices (an error without them).
    ``auto``: the devices of torch's current accelerator when there is one,
    else the CPUs. Devices are counted by torch, imported only for these
    values; without torch there is no accelerator.

    The count is at most what the node may run (:func:`_check_nproc`).

    Raises:
        RunOptionsError: Not a positive integer or one of the names, the
            named device is not available, or more workers than the node
            may run.
    """
    try:
        value = int(text)
    except ValueError:
        return _check_nproc(_named_world_size(text), text)
    if value < 1:
        raise RunOptionsError(f"--nproc-per-node {text!r} must be at least 1")
    return _check_nproc(value, text)


def _check_nproc(count: int, text: str) -> int:
    """Refuse more workers than this node may run; return ``count``.

    The limit is :data:`MAX_NPROC_VARIABLE` when it is set, else
    :data:`NPROC_PER_CPU` per usable CPU (at least ``_NPROC_FLOOR``); and never
    more processes than the kernel gives (``kernel.pid_max``, and the user's
    ``RLIMIT_NPROC`` unless root).
    """
    option = f"--nproc-per-node {text!r}"
    raw = os.environ.get(MAX_NPROC_VARIABLE)
    if raw is None:
        cpus = _usable_cpus()
        limit = max(_NPROC_FLOOR, NPROC_PER_CPU * cpus)
        if count > limit:
            raise RunOptionsError(
                f"{option} is more workers than this machine runs well: at most {limit:,} "
                f"({NPROC_PER_CPU} per usable CPU, {cpus} here); set {MAX_NPROC_VARIABLE}=N "
                "to allow N"
            )
    else:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if limit < 1:
            raise RunOptionsError(f"{MAX_NPROC_VARIABLE}={raw!r} is not a positive integer")
        if count > limit:
            raise RunOptionsError(f"{option} is more than {MAX_NPROC_VARIABLE}={limit}")
    kernel = _kernel_process_limit()
    if kernel is not None and count > kernel[0]:
        raise RunOptionsError(f"{option}: this machine runs at most {kernel[0]:,} ({kernel[1]})")
    return count


def _kernel_process_limit() -> tuple[int, str] | None:
    """The most processes the kernel lets this user have, and its name; None: no limit known."""
    limits: list[tuple[int, str]] = []
    try:
        with open("/proc/sys/kernel/pid_max") as file:
            limits.append((int(file.read()), "kernel.pid_max"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        limits.append((soft, "ulimit -u, RLIMIT_NPROC"))
    return min(limits) if limits else None


def _named_world_size(text: str) -> int:
    if text == "cpu":
        return _usable_cpus()
    if text not in ("gpu", "xpu", "auto"):
        raise RunOptionsError(
            f"--nproc-per-node {text!r} is not a positive integer, 'cpu', 'gpu', 'xpu' or 'auto'"
        )
    torch = _torch()
    if text == "auto":
        if torch is not None and torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return _usable_cpus()
    device = torch and (torch.cuda if text == "gpu" else torch.xpu)
    if device is None or not device.is_available():
        name = "CUDA" if text == "gpu" else "XPU"
        why = "torch is not installed" if torch is None else f"torch finds no {name} device"
        raise RunOptionsError(f"--nproc-per-node {text}: {name} is not available ({why})")
    return int(device.device_count())
