"""Metrics in Prometheus' text exposition format, served over HTTP, standard library only.

Theory of operation: a :class:`MetricsServer` runs ``http.server`` on a
daemon thread. Each ``GET /metrics`` calls the owner's ``collect`` function,
which reads its counters at that moment and returns metric
:class:`Family` objects; :func:`render` turns them into the text format
(version 0.0.4): per family a ``# HELP`` and a ``# TYPE`` line, then one
line per sample, ``name{label="value",...} number``. Nothing is computed in
the background, so an idle endpoint costs nothing.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rdzv.threads import start_thread

__all__ = ["CONTENT_TYPE", "Family", "MetricsServer", "Sample", "counter", "gauge", "render"]

_log = logging.getLogger(__name__)

#: The Content-Type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KINDS = ("counter", "gauge", "summary", "untyped")


@dataclass(frozen=True)
class Sample:
    """One sample of a family.

    Args:
        value: The number.
        labels: Its labels.
        suffix: Appended to the family's name (``_sum``, ``_count`` of a summary).
    """

    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    suffix: str = ""


@dataclass(frozen=True)
class Family:
    """A metric: its name, type, help text and samples.

    Args:
        name: The metric name (a counter's ends in ``_total``).
        kind: ``counter``, ``gauge``, ``summary`` or ``untyped``.
        help: One line saying what it measures.
        samples: Its samples.

    Raises:
        ValueError: A name, label name or kind is not valid.
    """

    name: str
    kind: str
    help: str
    samples: list[Sample]

    def __post_init__(self) -> None:
        if _NAME.fullmatch(self.name) is None:
            raise ValueError(f"metric name {self.name!r} is not valid")
        if self.kind not in _KINDS:
            raise ValueError(f"metric kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        for sample in self.samples:
            for label in sample.labels:
                if _LABEL.fullmatch(label) is None or label.startswith("__"):
                    raise ValueError(f"label name {label!r} of {self.name} is not valid")


def counter(name: str, help_text: str, value: float, **labels: str) -> Family:
    """Return a counter family with one sample."""
    return Family(name, "counter", help_text, [Sample(value, labels)])


def gauge(name: str, help_text: str, value: float, **labels: str) -> Family:
    """Return a gauge family with one sample."""
    return Family(name, "gauge", help_text, [Sample(value, labels)])


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def render(families: Iterable[Family]) -> str:
    """Render families in the text exposition format."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample in family.samples:
            labels = ""
            if sample.labels:
                pairs = (f'{k}="{_label_value(v)}"' for k, v in sorted(sample.labels.items()))
                labels = "{" + ",".join(pairs) + "}"
            lines.append(f"{family.name}{sample.suffix}{labels} {_number(sample.value)}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``GET /metrics`` on a daemon thread.

    Args:
        collect: Returns the current metrics; called once per scrape, on the
            server's thread.
        host: The address to listen on (all IPv4 interfaces by default).
        port: The port; 0 picks a free one.

    Raises:
        OSError: The address cannot be bound.
    """

    def __init__(
        self,
        collect: Callable[[], Iterable[Family]],
        host: str = "0.0.0.0",  # noqa: S104 - scraped from other machines
        port: int = 0,
    ) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = render(owner.collect()).encode()
                except Exception as exc:  # noqa: BLE001 - a scrape must answer, not kill the thread
                    _log.warning("collecting metrics failed: %s: %s", type(exc).__name__, exc)
                    self.send_error(500, "collecting the metrics failed")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                _log.debug("metrics %s: " + format, self.address_string(), *args)

        self.collect = collect
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = start_thread(self._server.serve_forever, name="rdzv-metrics")

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def host(self) -> str:
        """The address it listens on."""
        return str(self._server.server_address[0])

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
