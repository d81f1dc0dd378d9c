"""``--metrics-port`` on ``rdzv serve`` and ``rdzv run``, scraped over HTTP and parsed strictly."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv import TCPStore
from tests.launch.procs import WORKER, agents, c10d_args, finish, with_world
from tests.procs import subprocess_env, wait_until
from tests.promtext import ParsedFamily, parse
from tests.store.helpers import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_URL = re.compile(r"metrics at (http://\S+/metrics)")


def scrape(url: str) -> dict[str, ParsedFamily]:
    with urllib.request.urlopen(url, timeout=20) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(reply.read().decode())


def value(families: dict[str, ParsedFamily], name: str, sample: str | None = None) -> float:
    wanted = sample or name
    values = [v for n, _, v in families[name].samples if n == wanted]
    assert len(values) == 1, families[name]
    return values[0]


@pytest.fixture
def served() -> Iterator[tuple[int, str]]:
    """``rdzv serve`` with metrics and at most 2 connections: (store port, metrics URL)."""
    metrics = ("--max-connections=2", "--metrics-port=0", "--metrics-host=127.0.0.1")
    with serve_process(*metrics) as (server, port):
        assert server.stdout is not None
        line = server.stdout.readline()
        found = _URL.search(line)
        assert found is not None, line
        yield port, found.group(1)


def test_serve_counts_connections_requests_and_refusals(served: tuple[int, str]) -> None:
    port, url = served
    before = scrape(url)
    assert value(before, "rdzv_store_connections") == 0
    assert before["rdzv_store_requests_total"].kind == "counter"
    with TCPStore("127.0.0.1", port, timeout=10) as first, TCPStore("127.0.0.1", port) as second:
        first.set("k", "v")
        assert second.get("k") == b"v"
        during = scrape(url)
        assert value(during, "rdzv_store_connections") >= 2
        # a third connection is past --max-connections 2: refused
        with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
            third.settimeout(10)
            assert third.recv(1) == b""
        wait_until(
            lambda: value(scrape(url), "rdzv_store_connections_refused_total") >= 1,
            what="the refusal to be counted",
        )
    after = scrape(url)
    assert value(after, "rdzv_store_connections_accepted_total") >= 2
    requests = value(after, "rdzv_store_requests_total")
    assert requests >= value(during, "rdzv_store_requests_total")
    assert value(during, "rdzv_store_requests_total") >= 2
    for family in after.values():
        assert family.help, family.name


def test_run_exports_rounds_workers_and_heartbeat_ages(endpoint: str, tmp_path: Path) -> None:
    args = [
        "--metrics-port=0",
        "--metrics-host=127.0.0.1",
        *c10d_args(endpoint, "2", "metered"),
        WORKER,
        str(tmp_path),
        "wait-release",
    ]
    logs = [tmp_path / "a.err", tmp_path / "b.err"]
    with agents() as group:
        procs = [group.start(args, stderr_path=log) for log in logs]

        def urls() -> list[str]:
            found = [_URL.search(log.read_text()) for log in logs]
            return [m.group(1) for m in found if m is not None]

        wait_until(lambda: len(urls()) == 2, what="both metrics endpoints")
        wait_until(lambda: len(with_world(tmp_path, 2)) == 2, what="a round of 2 nodes")
        url = urls()[0]
        # heartbeats every 0.5 s: an age once a mark was seen to change between scrapes
        wait_until(
            lambda: len(scrape(url)["rdzv_agent_heartbeat_age_seconds"].samples) == 2,
            what="heartbeat ages of both members",
        )
        metrics = scrape(url)
        (tmp_path / "release-2").write_text("")
        results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    assert value(metrics, "rdzv_agent_rounds_total") == 1
    assert value(metrics, "rdzv_agent_join_seconds", "rdzv_agent_join_seconds_count") == 1
    assert value(metrics, "rdzv_agent_join_seconds", "rdzv_agent_join_seconds_sum") > 0
    assert value(metrics, "rdzv_agent_workers") == 1
    assert value(metrics, "rdzv_agent_round_nodes") == 2
    assert value(metrics, "rdzv_agent_ready") == 1
    assert value(metrics, "rdzv_agent_restarts") == 0
    assert value(metrics, "rdzv_agent_reforms_total") == 0
    assert value(metrics, "rdzv_agent_evictions_total") == 0
    info = metrics["rdzv_agent_info"].samples[0][1]
    assert info == {"backend": "c10d", "run_id": "metered"}
    ages = metrics["rdzv_agent_heartbeat_age_seconds"].samples
    assert all(age >= 0 for _, _, age in ages)
    assert {labels["node"].split("#")[0] for _, labels, _ in ages} == {"127.0.0.1"}


def test_a_taken_metrics_port_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rdzv.cli",
                "run",
                "--standalone",
                f"--metrics-port={port}",
                "--metrics-host=127.0.0.1",
                WORKER,
                str(tmp_path),
                "ok",
            ],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"rdzv run: error: --metrics-port: cannot listen on 127.0.0.1:{port}:")
    )
    assert "Traceback" not in done.stderr
