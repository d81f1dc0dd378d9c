"""The dynamic rendezvous: state and codec, the sans-I/O machine, and the handler (driver)."""

from rdzv.dynamic.handler import DynamicRendezvousHandler, create_handler

__all__ = ["DynamicRendezvousHandler", "create_handler"]
