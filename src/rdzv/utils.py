"""Endpoint helpers, under the module name torch uses for them.

``torch.distributed.elastic.rendezvous.utils`` exports one public helper,
:func:`parse_rendezvous_endpoint`; it is here with torch's exact semantics,
beside rdzv's stricter :func:`parse_endpoint` (which rdzv's backends use)
and :func:`format_endpoint`, its inverse.
"""

from __future__ import annotations

from rdzv.endpoint import format_endpoint, parse_endpoint, parse_rendezvous_endpoint

__all__ = ["format_endpoint", "parse_endpoint", "parse_rendezvous_endpoint"]
