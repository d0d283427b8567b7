"""The Triton generation model's metrics (:mod:`.triton_generate`), on Triton's own endpoint."""

from __future__ import annotations

import os


class Metrics:
    """The generation model's own gauges and counters on Triton's metrics endpoint
    (``/metrics``, Prometheus text; labelled by model): ``tfgraph_slots`` (slots in all),
    ``tfgraph_slots_active``, ``tfgraph_requests_waiting``, ``tfgraph_requests_ended_total`` by
    ``reason`` (``finished``, ``cancelled``: the client cancelled, ``unreachable``: a response
    could not be sent) and ``tfgraph_model_rss_bytes`` (this model's process). A server started
    without metrics, or a backend without custom metrics, records nothing."""

    REASONS = ("finished", "cancelled", "unreachable")

    def __init__(self, pb, model: str, batcher):
        self.gauges, self.ended, self._families = {}, {}, []
        try:
            gauge, counter = pb.MetricFamily.GAUGE, pb.MetricFamily.COUNTER
            for name, text in (
                ("tfgraph_slots", "cache slots of the generation model"),
                ("tfgraph_slots_active", "cache slots holding a request"),
                ("tfgraph_requests_waiting", "requests waiting for a slot"),
                ("tfgraph_model_rss_bytes", "resident memory of the generation model's process"),
            ):
                family = pb.MetricFamily(name=name, description=text, kind=gauge)
                self._families.append(family)  # a family lives as long as its object
                self.gauges[name] = family.Metric(labels={"model": model})
            ended = pb.MetricFamily(
                name="tfgraph_requests_ended_total",
                description="requests that left their slot, by reason",
                kind=counter,
            )
            self._families.append(ended)
            for reason in self.REASONS:
                self.ended[reason] = ended.Metric(labels={"model": model, "reason": reason})
        except Exception:  # noqa: BLE001 - metrics are optional
            self.gauges, self.ended = {}, {}
        if batcher is not None and "tfgraph_slots" in self.gauges:
            self.gauges["tfgraph_slots"].set(batcher.slots)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def update(self, active: int, waiting: int) -> None:
        if not self.gauges:
            return
        self.gauges["tfgraph_slots_active"].set(active)
        self.gauges["tfgraph_requests_waiting"].set(waiting)
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self._page
            self.gauges["tfgraph_model_rss_bytes"].set(rss)
        except OSError:
            pass

    def count(self, reason: str) -> None:
        metric = self.ended.get(reason)
        if metric is not None:
            metric.increment(1)
