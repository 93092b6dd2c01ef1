"""Prometheus metrics. Each app gets its own registry so that several apps (tests) can coexist."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge(
            "mint_queue_depth", "Operations accepted but not finished", ["queue"], registry=self.registry
        )
        self.op_latency = Histogram(
            "mint_operation_seconds",
            "Time from accepting an operation to its result (training steps, checkpoints)",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sample_latency = Histogram(
            "mint_sample_seconds", "Time from accepting a sample request to its result", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resident_adapters = Gauge(
            "mint_resident_adapters", "Adapters loaded in the engine", ["kind"], registry=self.registry
        )
        self.requests_failed = Counter(
            "mint_operations_failed_total", "Operations that finished with an error", ["op", "category"],
            registry=self.registry,
        )
        self.sessions = Gauge("mint_active_sessions", "Sessions with a recent heartbeat", registry=self.registry)
        self.engine_queue = Gauge("mint_engine_queue_depth", "Work queued inside the engine", registry=self.registry)

    def watch_engine(self, engine: object) -> None:
        """Export the engine's own queue depth when it reports one."""
        depth = getattr(engine, "queue_depth", None)
        if callable(depth):
            self.engine_queue.set_function(lambda: float(depth()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
