"""rdzv's public signatures against torch 2.13's, read live with ``inspect.signature``.

Every public class (its constructor and public methods, inherited ones too)
and function of the torch modules rdzv mirrors is compared with rdzv's
object of the same name: in the rdzv module mapped below, else in ``rdzv``
(where every public name of torch's rendezvous package imports from).
Differences are allowed only as ``tests.signatures.TORCH_DIFFERENCES``
lists them. torch's legacy etcd v2 modules (``etcd_rendezvous``,
``etcd_store``, ``etcd_server``) are not mirrored (docs/torch-compat.md, the
etcd row).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

from tests.signatures import TORCH_DIFFERENCES, drift, member, shape

TORCH = "torch.distributed.elastic.rendezvous"

# torch module (under TORCH; "api" is also the package's) -> rdzv module
MODULES = {
    "api": "rdzv",
    "dynamic_rendezvous": "rdzv.dynamic",
    "c10d_rendezvous_backend": "rdzv.backends.store",
    "etcd_rendezvous_backend": "rdzv.backends.etcd",
    "static_tcp_rendezvous": "rdzv.static",
    "registry": "rdzv.registry",
    "utils": "rdzv.utils",
}


def public_names(module: ModuleType) -> list[str]:
    """The classes and functions of ``__all__``, or of the module's own names without one."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        ]
    return [
        name
        for name in names
        if inspect.isclass(getattr(module, name)) or inspect.isfunction(getattr(module, name))
    ]


def torch_signatures(module: ModuleType, prefix: str) -> dict[str, object]:
    """``prefix.name`` -> torch's object: every class and its public methods, every function."""
    found: dict[str, object] = {}
    for name in public_names(module):
        value = getattr(module, name)
        found[f"{prefix}.{name}"] = value
        if inspect.isclass(value):
            for attr in dir(value):
                method = member(module.__name__, f"{name}.{attr}")
                if not attr.startswith("_") and (
                    inspect.isfunction(method) or inspect.ismethod(method)
                ):
                    found[f"{prefix}.{name}.{attr}"] = method
    return found


def test_every_signature_of_torchs_rendezvous_is_rdzvs_or_a_documented_difference() -> None:
    reference: dict[str, str] = {}
    ours: dict[str, str] = {}
    read = set()
    for torch_name, rdzv_name in MODULES.items():
        try:
            module = importlib.import_module(f"{TORCH}.{torch_name}")
        except ImportError:  # torch's etcd backend needs python-etcd
            continue
        read.add(torch_name)
        for name, value in torch_signatures(module, torch_name).items():
            qualname = name.split(".", 1)[1]
            rdzv_module = rdzv_name if member(rdzv_name, qualname.split(".")[0]) else "rdzv"
            reference[name] = shape(value)
            ours[name] = shape(member(rdzv_module, qualname))
    assert "api" in read
    allowed = {name: s for name, s in TORCH_DIFFERENCES.items() if name.split(".")[0] in read}
    assert drift(reference, ours, allowed) == []
