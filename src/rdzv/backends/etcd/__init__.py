"""The etcd v3 engine: the backend and its store over one of two clients.

:mod:`.backend` is the rendezvous backend and :mod:`.store` the key-value
store of a completed round; both use an etcd client through
:mod:`.client` (the transport-neutral base: the calls rdzv needs and the
failover between members). :mod:`.gateway` is the standard-library client
over etcd's JSON gateway, with its codec in :mod:`.gateway_codec`;
:mod:`.grpc` is the client over etcd's gRPC API (the ``etcd`` extra), with
its wire protocol in :mod:`.grpc_proto`. :mod:`.seats` packs the members'
seats into a fixed number of keys.
"""

from rdzv.backends.etcd.backend import (
    DEFAULT_KEY_PREFIX,
    EtcdRendezvousBackend,
    create_backend,
    create_client,
    open_etcd,
)
from rdzv.backends.options import parse_endpoints

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "EtcdRendezvousBackend",
    "create_backend",
    "create_client",
    "open_etcd",
    "parse_endpoints",
]
