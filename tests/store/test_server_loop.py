"""The store server's event loop option: asyncio by default, uvloop when asked for.

The uvloop tests skip, saying why, where uvloop is not installed (it is the
``rdzv[fast]`` extra, also in ``dev``); the tests of a missing uvloop hide it
instead, so they run everywhere.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time

import pytest

from rdzv.errors import StoreTimeoutError
from rdzv.store.server import EVENT_LOOPS, TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env
from tests.store.helpers import serve_process

pytestmark = pytest.mark.timeout(60)

needs_uvloop = pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None,
    reason="uvloop is not installed (the rdzv[fast] extra: pip install uvloop)",
)

# Runs rdzv with uvloop unimportable (None in sys.modules makes the import fail).
_WITHOUT_UVLOOP = "import sys\nsys.modules['uvloop'] = None\n"


def test_the_default_loop_is_asyncio() -> None:
    assert EVENT_LOOPS[0] == "asyncio"
    assert TCPStoreServer("127.0.0.1", 0).loop == "asyncio"


@pytest.mark.parametrize("loop", ["uv", "", "ASYNCIO", "trio"])
def test_an_unknown_loop_is_a_value_error_naming_the_option(loop: str) -> None:
    with pytest.raises(ValueError, match=r"^loop must be one of asyncio, uvloop, got "):
        TCPStoreServer("127.0.0.1", 0, loop=loop)


def _run(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        check=False,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )


def test_the_package_does_not_import_uvloop_unless_asked() -> None:
    done = _run(
        "import sys\n"
        "import rdzv, rdzv.cli, rdzv.store.tcp\n"
        "from rdzv.store.server import TCPStoreServer\n"
        "with TCPStoreServer('127.0.0.1', 0) as server:\n"
        "    rdzv.store.tcp.TCPStore('127.0.0.1', server.port, timeout=10).set('k', 'v')\n"
        "print('uvloop' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_uvloop_missing_is_an_import_error_saying_what_to_install() -> None:
    done = _run(
        _WITHOUT_UVLOOP + "from rdzv.store.server import TCPStoreServer\n"
        "try:\n"
        "    TCPStoreServer('127.0.0.1', 0, loop='uvloop')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "loop 'uvloop' needs the uvloop package (the rdzv[fast] extra), which is not installed: "
        "pip install uvloop\n"
    )


def test_rdzv_serve_loop_uvloop_without_uvloop_is_one_line() -> None:
    done = _run(
        _WITHOUT_UVLOOP + "from rdzv.cli import main\n"
        "sys.exit(main(['serve', '--host', '127.0.0.1', '--port', '0', '--loop', 'uvloop']))\n"
    )
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1, done.stderr
    assert "rdzv serve: loop 'uvloop' needs the uvloop package" in done.stderr
    assert "Traceback" not in done.stderr


def test_rdzv_serve_refuses_an_unknown_loop() -> None:
    done = _run(
        "import sys\nfrom rdzv.cli import main\n"
        "sys.exit(main(['serve', '--port', '0', '--loop', 'uv']))\n"
    )
    assert done.returncode == 2, done
    assert "argument --loop: invalid choice: 'uv'" in done.stderr


def _exercise(store: TCPStore, other: TCPStore) -> None:
    """The common operations, and a wait released by another client."""
    store.set("k", b"v1")
    assert store.get("k") == b"v1"
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.compare_set("k", b"v1", b"v2") == b"v2"
    assert store.compare_set("k", b"nope", b"v3") == b"v2"
    store.wait(["k"], timeout=5)
    with pytest.raises(StoreTimeoutError):
        store.wait(["absent"], timeout=0.2)
    assert store.get("k") == b"v2"  # still in step after the cancelled wait

    released = threading.Event()

    def waiter() -> None:
        store.wait(["late"], timeout=10)
        released.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.1)
    assert not released.is_set()
    other.set("late", b"x")
    thread.join(10)
    assert released.is_set()
    assert store.watch("k", b"v2", 0.1) == b"v2"
    assert other.num_keys() == 3


@needs_uvloop
def test_a_uvloop_server_serves_a_real_client() -> None:
    with TCPStoreServer("127.0.0.1", 0, loop="uvloop") as server:
        assert server.loop == "uvloop"
        with (
            TCPStore("127.0.0.1", server.port, timeout=10) as store,
            store.clone() as other,
        ):
            _exercise(store, other)
            assert server.connection_count() == 2


@needs_uvloop
def test_rdzv_serve_loop_uvloop_starts_answers_and_stops_by_pid() -> None:
    with serve_process("--loop", "uvloop") as (proc, port):
        with (
            TCPStore("127.0.0.1", port, timeout=10) as store,
            store.clone() as other,
        ):
            _exercise(store, other)
        assert proc.poll() is None
    assert proc.returncode == 0  # SIGTERM: a clean stop
