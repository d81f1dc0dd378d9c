"""Prometheus' text format (rdzv.metrics), its HTTP server, and an agent's metrics (rdzv.launch)."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest

from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import decode_state
from rdzv.launch.config import AgentStats
from rdzv.launch.metrics import agent_metrics
from rdzv.metrics import CONTENT_TYPE, Family, MetricsServer, Sample, counter, gauge, render
from rdzv.store.memory import HashStore
from rdzv.testing import InMemoryBackend
from tests.promtext import FormatError, parse

pytestmark = pytest.mark.timeout(30)


def test_render_is_valid_text_format_and_round_trips() -> None:
    families = [
        counter("x_requests_total", "requests\nseen, with a \\ backslash", 3),
        gauge("x_temperature", "a gauge", 21.5, room='a "quoted"\nname\\'),
        Family(
            "x_latency_seconds",
            "summary",
            "latency",
            [Sample(1.25, suffix="_sum"), Sample(4, suffix="_count")],
        ),
        Family("x_odd", "gauge", "special values", [Sample(math.inf, {"k": "v"}), Sample(-0.5)]),
    ]
    parsed = parse(render(families))
    assert parsed["x_requests_total"].kind == "counter"
    assert parsed["x_requests_total"].help == "requests\nseen, with a \\ backslash"
    assert parsed["x_requests_total"].samples == [("x_requests_total", {}, 3.0)]
    assert parsed["x_temperature"].samples == [
        ("x_temperature", {"room": 'a "quoted"\nname\\'}, 21.5)
    ]
    assert [s[0] for s in parsed["x_latency_seconds"].samples] == [
        "x_latency_seconds_sum",
        "x_latency_seconds_count",
    ]
    assert parsed["x_odd"].samples[0][2] == math.inf


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="metric name"):
        gauge("1bad", "x", 1)
    with pytest.raises(ValueError, match="label name"):
        gauge("ok", "x", 1, __reserved="v")
    with pytest.raises(ValueError, match="metric kind"):
        Family("ok", "meter", "x", [])


@pytest.mark.parametrize(
    "text",
    [
        "x 1",  # no final newline
        "x{a=b} 1\n",  # unquoted label value
        'x{a="\\q"} 1\n',  # an escape the format does not have
        "x one\n",
        "# TYPE x counter\nx -1\n",
        "x 1\n# TYPE x gauge\n",  # metadata after samples
        "x 1\ny 2\nx 3\n",  # not contiguous
        "# TYPE x gauge\n# TYPE x gauge\nx 1\n",
    ],
)
def test_the_test_parser_is_strict(text: str) -> None:
    with pytest.raises(FormatError):
        parse(text)


def test_the_server_answers_metrics_and_404_elsewhere() -> None:
    calls = []

    def collect() -> list[Family]:
        calls.append(1)
        return [counter("x_scrapes_total", "scrapes", len(calls))]

    with MetricsServer(collect, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"] == CONTENT_TYPE
            body = reply.read().decode()
        assert parse(body)["x_scrapes_total"].samples == [("x_scrapes_total", {}, 1.0)]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{url}/other", timeout=10)
        assert missing.value.code == 404
        missing.value.close()


def test_a_failing_collector_gives_500_and_the_server_keeps_serving() -> None:
    fail = [True]

    def collect() -> list[Family]:
        if fail[0]:
            raise RuntimeError("boom")
        return [gauge("x_up", "up", 1)]

    with MetricsServer(collect, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url, timeout=10)
        assert failed.value.code == 500
        failed.value.close()
        fail[0] = False
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert "x_up 1" in reply.read().decode()


def test_agent_metrics_show_the_stats_and_the_age_of_each_members_changed_heartbeat(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend = InMemoryBackend()
    handler = DynamicRendezvousHandler.from_backend(
        "job", HashStore(), backend, 1, 1, local_addr="127.0.0.1"
    )
    handlers.append(handler)
    stats = AgentStats(rounds=2, restarts=1, workers=4, world_size=1, first_round=True)
    collect = agent_metrics(stats, handler, max_restarts=3)

    def samples(name: str) -> list[Sample]:
        return next(family.samples for family in collect() if family.name == name)

    info = samples("rdzv_agent_info")[0].labels
    assert info == {"run_id": "job", "backend": handler.get_backend()}
    assert samples("rdzv_agent_rounds_total")[0].value == 2
    assert samples("rdzv_agent_max_restarts")[0].value == 3
    assert samples("rdzv_agent_workers")[0].value == 4
    assert samples("rdzv_agent_ready")[0].value == 1
    assert samples("rdzv_agent_heartbeat_age_seconds") == []  # no round yet
    handler.next_rendezvous()
    found = backend.get_state()
    assert found is not None
    (node,) = decode_state(found[0]).participants
    assert samples("rdzv_agent_heartbeat_age_seconds") == []  # a mark, not yet seen to change
    backend.beat(node)
    (age,) = samples("rdzv_agent_heartbeat_age_seconds")
    assert age.labels == {"node": node}
    assert age.value >= 0
