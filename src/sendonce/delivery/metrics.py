"""Prometheus metrics of a worker process (``sendonce worker --metrics-port``).

The figures are read from the worker when the endpoint is scraped, so the send path pays nothing
for them. Alert on ``sendonce_worker_database_outage_seconds > 60`` (an operation that has been
failing for a minute: a database down, or left read-only after a failover) and on
``sendonce_worker_fenced_out_total`` rising (outcomes refused because another worker had
re-claimed the row: leases too short for the sends, or a worker cut off from the database), and on
``sendonce_worker_transport_outage_seconds > 300`` (the relay or the provider has refused every try
for five minutes: the mail waits, nothing fails, but nothing goes out).

Where a worker's time goes, as counters of seconds to take the rate of: over SMTP,
``rate(sendonce_worker_record_wait_seconds_total) / concurrency`` is the share of the connections'
time spent waiting for their previous message's record (the database, not the relay, is then what
bounds the rate); ``rate(..._record_seconds_total) / rate(..._record_groups_total)`` is the time of
one grouped record, and likewise for claims; ``sendonce_worker_lane_waits_total`` rising fast says
the connections run out of claimed rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Thread
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from sendonce.delivery.worker import Worker

OUTCOMES = ("sent", "retried", "failed", "suppressed", "released", "deferred")

_STATS_COUNTERS = (
    ("claimed", "Rows claimed"),
    ("fenced_out", "Outcomes refused because another worker had re-claimed the row (zombie completions stopped)"),
    ("lost_leases", "Rows dropped because their lease was lost"),
    ("dropped_past_deadline", "Rows given back unsent because too little of their lease was left to start a send"),
    (
        "transport_failures",
        "Failures of the transport itself (unreachable, login or API key refused, 421, 429, 502-504): "
        "not counted against the messages, which wait",
    ),
    ("claims", "Claims answered (with rows or without)"),
    ("claim_seconds", "Time spent claiming, from the start of each claim to its rows queued for the connections"),
    ("record_groups", "Grouped records written (one commit each)"),
    ("record_seconds", "Time spent writing grouped records"),
    (
        "record_wait_seconds",
        "Time the connections held a message back until their previous accepted message was recorded "
        "(non-idempotent transports: at most one unrecorded message per connection)",
    ),
    (
        "record_waits",
        "Times a connection held a message back because its previous accepted message was not recorded yet",
    ),
    ("lane_waits", "Times a connection found no claimed row to send and waited for one"),
)
"""Counters read from :class:`~sendonce.delivery.worker.WorkerStats`, each named after its field."""


class WorkerCollector(Collector):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        stats = worker.stats
        info = InfoMetricFamily("sendonce_worker", "This worker process")
        info.add_metric([], {"name": worker.name, "transport": worker.transport.capabilities.name})
        yield info
        for field, text in _STATS_COUNTERS:
            yield CounterMetricFamily(f"sendonce_worker_{field}", text, value=getattr(stats, field))
        outcomes = CounterMetricFamily(
            "sendonce_worker_outcomes", "Outcomes recorded (released: given back unsent)", labels=["outcome"]
        )
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], getattr(stats, outcome))
        yield outcomes
        yield GaugeMetricFamily("sendonce_worker_held", "Rows this worker holds now", value=worker.held_count)
        yield CounterMetricFamily(
            "sendonce_worker_database_failures",
            "Database calls that failed because the database was unavailable (each retried)",
            value=worker.outages.failures,
        )
        outage = GaugeMetricFamily(
            "sendonce_worker_database_outage_seconds",
            "How long each database operation has been failing (0: it works)",
            labels=["operation"],
        )
        for operation, seconds in sorted(worker.outages.seconds().items()):
            outage.add_metric([operation], seconds)
        yield outage
        yield GaugeMetricFamily(
            "sendonce_worker_transport_outage_seconds",
            "How long the transport has been failing as a whole, the lanes pausing (0: it works)",
            value=worker.transport_outage_seconds,
        )


def serve_metrics(worker: Worker, host: str, port: int) -> tuple[WSGIServer, Thread]:
    """Serve ``/metrics`` for ``worker`` from a thread of its own; the server is shut down by the caller."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    return start_http_server(port, addr=host, registry=registry)
