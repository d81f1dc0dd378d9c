"""The fuzzers' budget: small in CI, scaled up by hand with ``RDZV_FUZZ_SCALE``.

``RDZV_FUZZ_SCALE=200 python -m pytest tests/fuzz --hypothesis-show-statistics``
runs every fuzzer with 200 times its CI number of examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("RDZV_FUZZ_SCALE", "1")))


def budget(examples: int) -> settings:
    """Return hypothesis settings running ``examples`` x :data:`SCALE` inputs, no deadline."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )
