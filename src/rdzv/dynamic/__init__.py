"""The dynamic rendezvous: state and codec, the sans-I/O machine, and the handler."""

from rdzv.dynamic.handler import DynamicRendezvousHandler, create_c10d_handler, create_handler

__all__ = ["DynamicRendezvousHandler", "create_c10d_handler", "create_handler"]
