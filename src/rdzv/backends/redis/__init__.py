"""The Redis engine: the backend, the store of a completed round, their connection."""

from rdzv.backends.redis.backend import (
    DEFAULT_KEY_PREFIX,
    RedisRendezvousBackend,
    create_backend,
    open_redis,
)

__all__ = ["DEFAULT_KEY_PREFIX", "RedisRendezvousBackend", "create_backend", "open_redis"]
