"""The fleet's figures: replicas' cumulative reports merged, and the Prometheus collector read at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any, Protocol

from mint_server.engine.fleet.routing import ReplicaView


class FleetView(Protocol):
    """What the collector reads of the fleet (FleetEngine is one)."""

    routed: Counter[tuple[int, str]]

    def affinity(self) -> dict[str, float]: ...
    def replica_views(self) -> list[ReplicaView]: ...


def add_cumulative(into: dict[str, Any], report: dict[str, Any]) -> None:
    """Add a report's cumulative counts (loads, evictions by reason; sampler totals) into `into`."""
    for family in ("loads", "evictions"):
        into.setdefault(family, Counter()).update(report.get(family, {}))
    sampler = into.setdefault("sampler", {})
    for kind, phases in report.get("sampler", {}).items():
        for phase, value in phases.items():
            sampler.setdefault(kind, {})[phase] = sampler.get(kind, {}).get(phase, 0.0) + value



class FleetCollector:
    """Per-replica figures and routing decisions, read at scrape time (after the engine's report)."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        routed = CounterMetricFamily("mint_fleet_routed", "Requests routed to a replica, by decision "
                                     "(home: the adapter's home; spill: home saturated; pinned: a training "
                                     "adapter's replica; base: no adapter; retry: its replica died)",
                                     labels=["replica", "decision"])
        for (i, decision), n in sorted(self.fleet.routed.items()):
            routed.add_metric([str(i), decision], n)
        yield routed
        hit = GaugeMetricFamily("mint_fleet_affinity_hit_rate", "Share of read-only-adapter requests served "
                                "by their home replica")
        hit.add_metric([], self.fleet.affinity()["affinity_hit_rate"])
        yield hit
        up = GaugeMetricFamily("mint_fleet_replica_up", "1 when the replica answers", labels=["replica"])
        inflight = GaugeMetricFamily("mint_fleet_replica_inflight", "Requests routed and unfinished",
                                     labels=["replica"])
        queue = GaugeMetricFamily("mint_fleet_replica_queue_depth", "Work queued inside the replica's engine",
                                  labels=["replica"])
        resident = GaugeMetricFamily("mint_fleet_replica_adapters", "Adapters by tier", labels=["replica", "tier"])
        kv = GaugeMetricFamily("mint_fleet_replica_kv_blocks_in_use", "KV cache blocks held by running samples",
                               labels=["replica"])
        steps = CounterMetricFamily("mint_fleet_replica_step_seconds", "Engine worker turns (count, seconds)",
                                    labels=["replica", "stat"])
        restarts = CounterMetricFamily("mint_fleet_replica_restarts", "Times Ray replaced the replica",
                                       labels=["replica"])
        for r in self.fleet.replica_views():
            i = str(r.index)
            up.add_metric([i], 1.0 if r.up else 0.0)
            inflight.add_metric([i], r.inflight)
            queue.add_metric([i], r.report.get("queue_depth", 0))
            kv.add_metric([i], r.report.get("kv_blocks_in_use", 0))
            for tier, n in r.report.get("resident", {}).items():
                resident.add_metric([i, tier], n)
            steps.add_metric([i, "count"], r.step_count)
            steps.add_metric([i, "sum"], r.step_sum)
            restarts.add_metric([i], r.restarts)
        yield from (up, inflight, queue, resident, kv, steps, restarts)
