"""The Batch API's Prometheus gauges, read from its runner when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from meshserve.engine.serving.batch.runner import BatchRunner


def batch_metrics(runner: BatchRunner, registry: CollectorRegistry) -> None:
    """Requests of unfinished jobs by state, and those answered by outcome."""
    states = Gauge("meshserve_batch_requests", "Batch API requests of unfinished jobs: queued (not yet handed to "
                   "the engine) or running", ["state"], registry=registry)
    states.labels("queued").set_function(lambda: runner.num_queued)
    states.labels("running").set_function(lambda: runner.in_flight)
    done = Gauge("meshserve_batch_requests_answered", "Batch API requests answered since the server started, by "
                 "outcome (completed: 200; failed: in the job's error file)", ["outcome"], registry=registry)
    done.labels("completed").set_function(lambda: runner.num_completed)
    done.labels("failed").set_function(lambda: runner.num_failed)
