"""The front door's /metrics: its own counters and gauges, labelled by replica, and each
serving replica's metrics (scraped from its HTTP server when /metrics is read) with a
`replica` label added, so one scrape of the front door sees the whole deployment."""

from __future__ import annotations

import logging
from typing import Callable

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from meshserve.engine.serving.replicas.replica_states import ReplicaStates
from meshserve.engine.serving.replicas.routing import Route, Router

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0


class RouterMetrics:
    def __init__(self, router: Router, registry: CollectorRegistry, states: ReplicaStates | None = None):
        self.routed = Counter("meshserve_router_requests", "Requests routed, by replica and why there (history: a "
                              "conversation's earlier turn; cache: the longest cached prefix; least_loaded)",
                              ["replica", "reason"], registry=registry)
        self.cached_tokens = Counter("meshserve_router_expected_cached_tokens", "Prompt tokens the router expected "
                                     "the chosen replica to hold in its prefix cache", ["replica"], registry=registry)
        self.retries = Counter("meshserve_router_retries", "Requests started over on another replica (their "
                               "replica failed or refused them before any output)", ["replica"], registry=registry)
        self.migrations = Counter("meshserve_router_migrations", "Requests moved with their output so far to "
                                  "another replica (their replica failed), by the replica they left", ["replica"],
                                  registry=registry)
        self.failures = Counter("meshserve_replica_failures", "Replicas taken out of service", ["replica"],
                                registry=registry)
        self.restarts = Counter("meshserve_replica_restarts", "Replicas restarted that serve again", ["replica"],
                                registry=registry)
        registry.register(_RouterState(router, states))
        self.block_size = router.block_size

    def routed_to(self, route: Route) -> None:
        self.routed.labels(str(route.replica), route.reason).inc()
        self.cached_tokens.labels(str(route.replica)).inc(route.cached_blocks * self.block_size)

    def retried(self, replica: int) -> None:
        self.retries.labels(str(replica)).inc()

    def migrated(self, replica: int) -> None:
        self.migrations.labels(str(replica)).inc()

    def replica_down(self, replica: int) -> None:
        self.failures.labels(str(replica)).inc()

    def replica_up(self, replica: int) -> None:
        self.restarts.labels(str(replica)).inc()


def front_door_registry(router: Router, urls: Callable[[], list[tuple[int, str]]], api_key: str | None = None,
                        states: ReplicaStates | None = None) -> tuple[CollectorRegistry, RouterMetrics]:
    """The front door's /metrics registry: its RouterMetrics, and the replicas' (`urls`: the
    base URLs of the replicas serving now) scraped and labelled."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(router, registry, states)
    registry.register(ReplicaScrape(urls, api_key, skip=("meshserve_http_responses",)))
    return registry, metrics


class _RouterState:
    """Gauges read from the router when /metrics is read."""

    def __init__(self, router: Router, states: ReplicaStates | None):
        self.router, self.states = router, states

    def collect(self):
        up = GaugeMetricFamily("meshserve_replica_up", "1 while the replica serves, 0 once out of service",
                               labels=["replica"])
        load = GaugeMetricFamily("meshserve_replica_load_tokens", "Tokens of the requests queued and running on the "
                                 "replica (prompts and output so far), as the router counts them", labels=["replica"])
        running = GaugeMetricFamily("meshserve_replica_requests", "Requests the router has in flight on the replica",
                                    labels=["replica"])
        for r in range(self.router.num_replicas):
            up.add_metric([str(r)], 1.0 if self.router.up[r] else 0.0)
            load.add_metric([str(r)], self.router.load(r))
            running.add_metric([str(r)], self.router.requests(r))
        yield from (up, load, running)
        if self.states is not None:
            state = GaugeMetricFamily("meshserve_replica_state", "1 for each replica's state now (starting, serving, "
                                      "draining, restarting, failed, stopped, removed)", labels=["replica", "state"])
            for r, s in enumerate(list(self.states.state)):
                state.add_metric([str(r), s.value], 1.0)
            yield state


class ReplicaScrape:
    """Each serving replica's /metrics, relabelled: `urls()` gives (replica, base URL) of the
    replicas up now."""

    def __init__(self, urls: Callable[[], list[tuple[int, str]]], api_key: str | None = None, skip: tuple[str, ...] = ()):
        self.urls, self.skip = urls, skip
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, url in self.urls():
            try:
                text = httpx.get(f"{url}/metrics", headers=self.headers, timeout=SCRAPE_TIMEOUT_S).text
            except httpx.HTTPError as e:
                log.warning("replica %d: /metrics did not answer (%s)", replica, e)
                continue
            for family in text_string_to_metric_families(text):
                if family.name.startswith(self.skip):
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples += [Sample(s.name, {**s.labels, "replica": str(replica)}, s.value, s.timestamp,
                                          s.exemplar) for s in family.samples]
        yield from families.values()
