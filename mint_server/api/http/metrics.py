"""Prometheus metrics. Each app gets its own registry so that several apps (tests) can coexist."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mint_server.engine.interface import Engine, EngineReport, Priority

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
        self.requests_failed = Counter(
            "mint_operations_failed_total", "Operations that finished with an error", ["op", "category"],
            registry=self.registry,
        )
        self.sessions = Gauge("mint_active_sessions", "Sessions with a recent heartbeat", registry=self.registry)
        self.engine_queue = Gauge("mint_engine_queue_depth", "Work queued inside the engine", registry=self.registry)
        self.adapters_resident = Gauge(
            "mint_adapters_resident", "Adapters known to the engine, by the tier they live in", ["tier"],
            registry=self.registry,
        )
        self.adapter_loads = Counter(
            "mint_adapter_loads", "Adapter loads into the next tier up, by where they came from", ["source"],
            registry=self.registry,
        )
        self.adapter_evictions = Counter(
            "mint_adapter_evictions", "Adapters moved out of a tier", ["tier"], registry=self.registry
        )
        self.adapter_load_seconds = Histogram(
            "mint_adapter_load_seconds", "Reading and decoding one adapter from the store",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry,
        )
        self.waiting_for_adapter = Gauge(
            "mint_requests_waiting_for_adapter", "Queued requests whose adapter is not in a device slot yet",
            registry=self.registry,
        )
        self.engine_step = Histogram(
            "mint_engine_step_seconds", "One turn of the engine worker (a training pass or op, plus a sampler step)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry,
        )
        self.sampler_totals = {
            kind: Counter(f"mint_sampler_{kind}", f"Sampler {kind} of its steps, by phase", ["phase"],
                          registry=self.registry)
            for kind in ("seconds", "tokens", "forwards", "rows")
        }
        self.prefix_cache = Counter("mint_prefix_cache", "The prefix cache: hit_tokens (prompt positions taken from "
                                    "it, not computed), query_tokens (prompt tokens of new prompt rows that could "
                                    "use it; hit rate = hit_tokens / query_tokens), evictions (blocks taken for "
                                    "other use)", ["phase"], registry=self.registry)
        self.prefix_cache_blocks = Gauge("mint_prefix_cache_blocks", "KV blocks the prefix cache holds (in use "
                                         "or kept for later requests)", registry=self.registry)
        self.step_tokens = Counter("mint_step_tokens", "Tokens the engine's steps ran: decode, prefill, training",
                                   ["kind"], registry=self.registry)
        token_buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.latency = {
            kind: Histogram(f"mint_{kind}_seconds", text, ["priority"], buckets=token_buckets, registry=self.registry)
            for kind, text in (("time_to_first_token", "Submit to a request's first sampled token"),
                               ("inter_token", "Between one sequence's consecutive tokens"),
                               ("queue_wait", "Submit to admission (KV reserved, prefill scheduled)"))
        }
        self.key_tokens = Gauge("mint_key_tokens_served", "Tokens served per API key (owner id prefix): fair shares",
                                ["key"], registry=self.registry)
        self.kv_blocks = Gauge("mint_kv_blocks_in_use", "KV cache blocks held by running sequences",
                               registry=self.registry)
        self.streams = Gauge("mint_openai_streams", "OpenAI-face responses in flight", registry=self.registry)
        self.calibration = Gauge("mint_engine_calibration", "What the engine measured at start-up on this machine "
                                 "(skinny_rows, max_step_tokens, step and adapter costs in seconds)", ["quantity"],
                                 registry=self.registry)
        self.compile = Counter("mint_compile", "The compiled decode step (docs/engine.md): compiled_steps, "
                               "eager_steps, graphs, recompiles, graph_breaks, failures, compile_seconds",
                               ["event"], registry=self.registry)
        self.training = Counter("mint_training", "Training passes: packed_passes, padded_passes (families or modes "
                                "that pad), tokens (real), padding_tokens (computed on padding)", ["kind"],
                                registry=self.registry)
        self.precision_mismatches = Gauge(
            "mint_adapter_precision_mismatches", "Catalog revisions resolved here that were trained on a base of "
            "another precision than this server's (each warned about once: docs/quantization.md)",
            registry=self.registry)
        self._engine: Engine | None = None
        self._seen: dict[tuple[str, str], float] = {}

    def watch_engine(self, engine: Engine) -> None:
        """Export the engine's own figures (queue, residency, step times) at each scrape."""
        self._engine = engine
        self.engine_queue.set_function(lambda: float(engine.queue_depth()))
        engine.register_metrics(self.registry)  # an engine's own families (a fleet's routing)

    def _pull_engine(self) -> EngineReport | None:
        if self._engine is None:
            return None
        r = self._engine.report()
        for tier, n in r["resident"].items():
            self.adapters_resident.labels(tier).set(n)
        for family, counter in (("loads", self.adapter_loads), ("evictions", self.adapter_evictions)):
            for label, total in r[family].items():
                self._advance(counter, family, label, total)
        for seconds in r["load_seconds"]:
            self.adapter_load_seconds.observe(seconds)
        for seconds in r["step_seconds"]:
            self.engine_step.observe(seconds)
        for kind, phases in r["sampler"].items():
            for phase, total in phases.items():
                if kind == "prefix_cache" and phase == "blocks":
                    self.prefix_cache_blocks.set(total)
                else:
                    self._advance(self.prefix_cache if kind == "prefix_cache" else self.sampler_totals[kind],
                                  f"sampler_{kind}", phase, total)
        for kind, total in r["step_tokens"].items():
            self._advance(self.step_tokens, "step_tokens", kind, total)
        names = {"ttft": "time_to_first_token", "itl": "inter_token", "queue": "queue_wait"}
        for priority, kind, seconds in r["latencies"]:
            self.latency[names[kind]].labels(Priority(priority).name.lower()).observe(seconds)
        for key, tokens in r["served"].items():
            self.key_tokens.labels(key[:12] or "-").set(tokens)
        self.waiting_for_adapter.set(r["waiting_for_adapter"])
        self.kv_blocks.set(r["kv_blocks_in_use"])
        for kind, total in r.get("training", {}).items():
            self._advance(self.training, "training", kind, total)
        for event, total in r.get("compile", {}).items():
            self._advance(self.compile, "compile", event, total)
        for quantity, value in r.get("calibration", {}).items():
            self.calibration.labels(quantity).set(value)
        return r

    def _advance(self, counter: Counter, family: str, label: str, total: float) -> None:
        """The engine counts cumulatively: add to the counter what is new since the last scrape."""
        delta = total - self._seen.get((family, label), 0)
        if delta > 0:
            counter.labels(label).inc(delta)
        self._seen[(family, label)] = total

    def engine_view(self) -> dict[str, Any]:
        """The engine's current figures for the dashboard: residency tiers, queue, fair-share tokens
        per key. Pulled like a scrape, so what the report hands over once still reaches /metrics."""
        r = self._pull_engine()
        if r is None:
            return {"resident": {}, "served": {}, "waiting_for_adapter": 0, "kv_blocks_in_use": 0, "engine_queue": 0}
        assert self._engine is not None
        return {"resident": dict(r["resident"]), "served": dict(r.get("served", {})),
                "waiting_for_adapter": r["waiting_for_adapter"], "kv_blocks_in_use": r["kv_blocks_in_use"],
                "engine_queue": self._engine.queue_depth()}

    def render(self) -> bytes:
        self._pull_engine()
        return generate_latest(self.registry)
