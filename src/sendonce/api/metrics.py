"""Prometheus metrics of the API, in a registry of the app's own (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

MAX_CLIENT_LABELS = 1000


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.signups = Counter(
            "sendonce_signup_requests", "Signup requests by outcome", ["result"], registry=self.registry
        )
        self.repeats = Counter(
            "sendonce_absorbed_repeats",
            "Repeated requests answered without doing anything again, per account",
            ["account", "mechanism"],
            registry=self.registry,
        )
        self.repeats_by_client = Counter(
            "sendonce_absorbed_repeats_by_client",
            "Repeated requests absorbed, per client address (at most 1000 addresses, then 'other')",
            ["client"],
            registry=self.registry,
        )
        self.alerts = Counter("sendonce_alerts", "Alerts raised", ["kind"], registry=self.registry)
        self.alerts_unrecorded = Counter(
            "sendonce_alerts_unrecorded",
            "Alerts raised that could not be stored (a database error after the request committed); logged",
            ["kind"],
            registry=self.registry,
        )
        self._clients: set[str] = set()

    def repeat(self, account_id: int, client: str, mechanism: str) -> None:
        self.repeats.labels(str(account_id), mechanism).inc()
        if client not in self._clients and len(self._clients) >= MAX_CLIENT_LABELS:
            client = "other"
        self._clients.add(client)
        self.repeats_by_client.labels(client).inc()
