"""Test helpers for rdzv and for backends and stores written for it.

* :class:`FakeClock` -- a monotonic clock moved by ``advance()``; and
  :class:`AutojumpClock`, one that moves itself whenever every thread
  running on it waits, so code that uses rdzv is tested without sleeping.
* :class:`InMemoryBackend` -- a backend with every capability, in memory.
* :mod:`rdzv.testing.conformance` -- the backend suite: :data:`BACKEND_CHECKS`
  over a :class:`BackendHarness`.
* :mod:`rdzv.testing.store_conformance` -- the Store suite:
  :data:`STORE_CHECKS` over a :class:`StoreHarness`.

Both suites are checks as data, need nothing but the standard library, and
come with a runner (:func:`run_conformance`, :func:`run_store_conformance`).
"""

from rdzv.testing.clock import AutojumpClock, FakeClock
from rdzv.testing.conformance import (
    BACKEND_CHECKS,
    BackendHarness,
    CapabilityMissing,
    Check,
    ConformanceError,
    run_conformance,
)
from rdzv.testing.memory import InMemoryBackend, InMemoryRendezvousStorage, OperationCounts
from rdzv.testing.store_conformance import (
    STORE_CHECKS,
    StoreCapability,
    StoreCheck,
    StoreHarness,
    run_store_conformance,
)

__all__ = [
    "BACKEND_CHECKS",
    "STORE_CHECKS",
    "AutojumpClock",
    "BackendHarness",
    "CapabilityMissing",
    "Check",
    "ConformanceError",
    "FakeClock",
    "InMemoryBackend",
    "InMemoryRendezvousStorage",
    "OperationCounts",
    "StoreCapability",
    "StoreCheck",
    "StoreHarness",
    "run_conformance",
    "run_store_conformance",
]
