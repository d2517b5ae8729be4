"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms with labels; gauges may be computed at scrape time (`collect=`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:  # noqa: A002
        self.name = name
        self.help = help
        self.label_names = tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:  # noqa: A002
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def render(self) -> list[str]:
        return self.header() + [
            f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in sorted(self.values.items())
        ]


class Gauge(Counter):
    kind = "gauge"

    def __init__(
        self,
        name: str,
        help: str,  # noqa: A002
        labels: Iterable[str] = (),
        collect: Callable[[], dict[tuple[str, ...], float]] | None = None,
    ) -> None:
        super().__init__(name, help, labels)
        self.collect = collect

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def render(self) -> list[str]:
        if self.collect is not None:
            self.values = dict(self.collect())
        return super().render()


class CounterFn(Gauge):
    """A counter whose value is read at scrape time."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,  # noqa: A002
        labels: Iterable[str] = (),
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list[float]] = {}  # per label set: bucket counts..., +Inf, sum

    def observe(self, value: float, *labels: str) -> None:
        row = self.series.get(labels)
        if row is None:
            row = self.series[labels] = [0.0] * (len(self.buckets) + 2)
        row[bisect.bisect_left(self.buckets, value)] += 1
        row[-1] += value

    def render(self) -> list[str]:
        lines = self.header()
        for key, row in sorted(self.series.items()):
            running = 0.0
            for bound, count in zip((*self.buckets, math.inf), row[:-1], strict=True):
                running += count
                le = 'le="' + _num(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {_num(running)}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(row[-1])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_num(running)}")
        return lines

    def quantile(self, q: float, *labels: str) -> float | None:
        """An estimate from the buckets (upper bound of the bucket holding the q-quantile)."""
        row = self.series.get(labels)
        if not row:
            return None
        total = sum(row[:-1])
        running = 0.0
        for bound, count in zip((*self.buckets, math.inf), row[:-1], strict=True):
            running += count
            if running >= q * total:
                return bound
        return None


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> Any:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.metrics:
            lines += metric.render()  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def node_metrics(server: Any) -> Registry:
    """The node's metrics, fed by the server's per-request observer and read from the service at scrape."""
    service = server.service
    reg = Registry()
    latency = reg.add(Histogram("shoal_node_request_seconds", "Time to serve a request, by operation", ["op"]))
    errors = reg.add(Counter("shoal_node_errors_total", "Requests that failed, by operation and error", ["op", "type"]))
    rejections = reg.add(Counter("shoal_node_rejections_total", "Creates refused for lack of capacity or quota"))

    def observe(op: str, seconds: float, error: str | None) -> None:
        latency.observe(seconds, op)
        if error is not None:
            errors.inc(op, error)
            if op == "create" and error in ("CapacityError", "QuotaExceededError"):
                rejections.inc()

    server.observers.append(observe)

    def by_state() -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for sandbox in list(service.sandboxes.values()):
            key = (sandbox.spec.kind, sandbox.state.value)
            out[key] = out.get(key, 0) + 1
        return out

    reg.add(Gauge("shoal_node_sandboxes", "Live sandboxes by kind and state", ["kind", "state"], collect=by_state))
    reg.add(Gauge("shoal_node_creating", "Sandboxes being created", collect=lambda: {(): service.creating}))
    reg.add(
        Gauge(
            "shoal_node_capacity",
            "Most sandboxes this node holds",
            collect=lambda: {(): service.settings.max_sandboxes},
        )
    )
    reg.add(
        CounterFn(
            "shoal_node_pool_hits_total", "Creates served from a warm pool", collect=lambda: {(): service.pools.hits}
        )
    )
    reg.add(CounterFn("shoal_node_pool_misses_total", "Creates made cold", collect=lambda: {(): service.pools.misses}))
    reg.add(Gauge("shoal_node_connections", "Open client connections", collect=lambda: {(): server.connections}))
    return reg
