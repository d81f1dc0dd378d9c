"""Test helpers for rdzv and for backends written for it.

* :class:`FakeClock` -- a monotonic clock moved by ``advance()``.
* :class:`InMemoryBackend` -- a backend with every capability, in memory.
* :mod:`rdzv.testing.conformance` -- the shared backend conformance suite.
"""

from rdzv.testing.clock import FakeClock
from rdzv.testing.memory import InMemoryBackend, InMemoryRendezvousStorage, OperationCounts

__all__ = ["FakeClock", "InMemoryBackend", "InMemoryRendezvousStorage", "OperationCounts"]
