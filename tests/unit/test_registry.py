import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import rdzv
import rdzv.static
from rdzv import RendezvousHandler, RendezvousHandlerRegistry, RendezvousParameters, registry
from rdzv.errors import explained
from rdzv.registry import BACKEND_FACTORIES, open_backend
from tests.procs import ROOT, SRC, subprocess_env
from tests.unit.test_api import _Handler


def _creator(params: RendezvousParameters) -> RendezvousHandler:
    return _Handler()


def _other_creator(params: RendezvousParameters) -> RendezvousHandler:
    return _Handler()


def test_register_and_create() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("fake", _creator)
    handler = reg.create_handler(RendezvousParameters("fake", "e", "r", 1, 1))
    assert isinstance(handler, _Handler)
    assert reg.backends() == {"fake": __name__}


def test_register_same_creator_twice_is_fine() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("fake", _creator)
    reg.register("fake", _creator)


def test_register_different_creator_is_rejected() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("fake", _creator)
    with pytest.raises(ValueError, match=r"'fake'.*already registered"):
        reg.register("fake", _other_creator)


def test_register_empty_name_is_rejected() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("", _creator)


def test_unknown_backend_lists_known_ones() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("alpha", _creator)
    reg.register("beta", _other_creator)
    with pytest.raises(ValueError, match="gamma") as caught:
        reg.create_handler(RendezvousParameters("gamma", "e", "r", 1, 1))
    assert re.search(
        r"^The rendezvous backend 'gamma' is not registered\. Did you forget to call "
        r"`register`\?$",
        str(caught.value),
    )
    assert explained(caught.value).endswith(
        "`register`? Known backends: alpha, beta; a backend from another package is "
        "registered when that package is installed."
    )


def test_messages_are_torchs_text_exactly() -> None:
    """torch's tests match these messages with anchored patterns; rdzv's detail is a note."""
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("dummy_backend", _creator)
    with pytest.raises(ValueError, match="dummy_backend") as caught:
        reg.register("dummy_backend", _other_creator)
    pattern = (
        r"^The rendezvous backend 'dummy_backend' cannot be registered with "
        rf"'{_other_creator}' as it is already registered with '{_creator}'.$"
    )
    assert re.search(pattern, str(caught.value))
    assert getattr(caught.value, "__notes__", None) == [f"It came from {__name__}."]


@pytest.fixture
def plugin_path(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "good_rdzv_plugin.py").write_text(
        textwrap.dedent(
            """
            from tests.unit.test_api import _Handler
            CALLS = []
            class GoodHandler(_Handler):
                def get_backend(self):
                    return "good"
            def create(params):
                CALLS.append(params)
                return GoodHandler()
            """
        )
    )
    dist = tmp_path / "good_rdzv_plugin-1.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: good-rdzv-plugin\nVersion: 1.2\n")
    (dist / "entry_points.txt").write_text(
        "[rdzv.handlers]\ngood = good_rdzv_plugin:create\nbroken = no_such_module_xyz:create\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("good_rdzv_plugin", None)


def test_entry_points_load_lazily_once_and_broken_ones_warn(plugin_path: Path) -> None:
    reg = RendezvousHandlerRegistry()
    assert "good_rdzv_plugin" not in sys.modules
    with pytest.warns(RuntimeWarning, match=r"'broken'.*No module named"):
        handler = reg.create_handler(RendezvousParameters("good", "e", "r", 1, 1))
    assert isinstance(handler, _Handler)
    origins = reg.backends()
    assert "good-rdzv-plugin 1.2" in origins["good"]
    assert "broken" not in origins
    module = sys.modules["good_rdzv_plugin"]
    assert len(module.CALLS) == 1
    # Loaded once: no second warning.
    reg.create_handler(RendezvousParameters("good", "e", "r", 1, 1))


def test_module_level_registry_and_create_handler() -> None:
    assert isinstance(rdzv.rendezvous_handler_registry, RendezvousHandlerRegistry)
    with pytest.raises(ValueError, match="not registered"):
        rdzv.create_handler(RendezvousParameters("definitely-not-a-backend", "e", "r", 1, 1))


def test_the_specs_other_names_for_the_registry_and_its_factories() -> None:
    assert rdzv.get_registry() is rdzv.rendezvous_handler_registry
    static = RendezvousParameters("static", "127.0.0.1:1", "r", 1, 1)
    for build in (registry.get_rendezvous_handler, rdzv.static.create_handler):
        handler = build(static)
        assert isinstance(handler, rdzv.StaticTCPRendezvous)
        assert handler.get_run_id() == "r"
    with pytest.raises(ValueError, match="not registered"):
        registry.get_rendezvous_handler(RendezvousParameters("no-such-backend", "e", "r"))
    params = RendezvousParameters("c10d", "h:1", "r", join_timeout=7, heartbeat=2)
    timeout = rdzv.RendezvousTimeout.from_params(params)
    assert (timeout.join.total_seconds(), timeout.heartbeat.total_seconds()) == (7, 2)


def test_cli_version_and_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "--version"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"rdzv {rdzv.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "backends"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for name, origin in rdzv.rendezvous_handler_registry.backends().items():
        assert name in out.stdout
        assert origin in out.stdout


def test_cli_without_command_prints_help_and_fails() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rdzv.cli"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "backends" in out.stderr


def test_builtin_dynamic_backends_share_one_generic_creator() -> None:
    origins = rdzv.rendezvous_handler_registry.backends()
    for name, path in BACKEND_FACTORIES.items():
        assert path in origins[name]
    assert "rdzv.static" in origins["static"]


def test_open_backend_rejects_a_handler_that_is_not_dynamic() -> None:
    reg = RendezvousHandlerRegistry(load_entry_points=False)
    reg.register("fake", _creator)
    with pytest.raises(ValueError, match="'fake' builds a _Handler, not a dynamic"):
        open_backend(RendezvousParameters("fake", "e", "r", 1, 1), reg)


@pytest.fixture
def store_plugin_path(tmp_path: Path) -> Path:
    """A third-party backend, ``mystore``, registered only through ``rdzv.handlers``."""
    (tmp_path / "mystore_plugin.py").write_text(
        textwrap.dedent(
            """
            from rdzv import DynamicRendezvousHandler, TCPStore
            from rdzv.backends.store import C10dRendezvousBackend
            from rdzv.endpoint import parse_endpoint

            class MyStoreBackend(C10dRendezvousBackend):
                @property
                def name(self):
                    return "mystore"

            def create(params):
                host, port = parse_endpoint(params.endpoint)
                store = TCPStore(host, port, timeout=10)
                backend = MyStoreBackend(store, params.run_id)
                return DynamicRendezvousHandler.from_backend(
                    params.run_id, store, backend, params.min_nodes, params.max_nodes
                )
            """
        )
    )
    dist = tmp_path / "mystore_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mystore-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rdzv.handlers]\nmystore = mystore_plugin:create\n")
    return tmp_path


@pytest.mark.timeout(90)
def test_rdzv_status_reads_a_plugin_backend(store_plugin_path: Path) -> None:
    server = rdzv.TCPStore("127.0.0.1", 0, is_master=True)
    sys.path.insert(0, str(store_plugin_path))
    try:
        reg = RendezvousHandlerRegistry()
        handler = reg.create_handler(
            RendezvousParameters("mystore", f"127.0.0.1:{server.port}", "plugged", 1, 1)
        )
        assert isinstance(handler, rdzv.DynamicRendezvousHandler)
        info = handler.next_rendezvous()
        assert info.world_size == 1
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rdzv.cli",
                "status",
                "--rdzv-backend",
                "mystore",
                "--rdzv-endpoint",
                f"127.0.0.1:{server.port}",
                "--rdzv-id",
                "plugged",
                "--json",
                "--sample",
                "0",
            ],
            env=subprocess_env(
                PYTHONPATH=f"{SRC}{os.pathsep}{ROOT}{os.pathsep}{store_plugin_path}"
            ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["round"] == 0
        assert [m["node"] for m in status["members"]] == [handler.node]
        handler.shutdown()
        handler.close()
    finally:
        sys.path.remove(str(store_plugin_path))
        sys.modules.pop("mystore_plugin", None)
        server.close()
