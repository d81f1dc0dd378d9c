"""Test helpers for rdzv and for backends and stores written for it.

* :class:`FakeClock` -- a monotonic clock moved by ``advance()``.
* :class:`InMemoryBackend` -- a backend with every capability, in memory.
* :mod:`rdzv.testing.conformance` -- the backend suite: :data:`BACKEND_CHECKS`
  over a :class:`BackendHarness`.

The suite is checks as data, needs nothing but the standard library, and
comes with a runner (:func:`run_conformance`).
"""

from rdzv.testing.clock import FakeClock
from rdzv.testing.conformance import (
    BACKEND_CHECKS,
    BackendHarness,
    CapabilityMissing,
    Check,
    ConformanceError,
    run_conformance,
)
from rdzv.testing.memory import InMemoryBackend, InMemoryRendezvousStorage, OperationCounts

__all__ = [
    "BACKEND_CHECKS",
    "BackendHarness",
    "CapabilityMissing",
    "Check",
    "ConformanceError",
    "FakeClock",
    "InMemoryBackend",
    "InMemoryRendezvousStorage",
    "OperationCounts",
    "run_conformance",
]
