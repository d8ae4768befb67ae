"""Prometheus metrics of the server: raw counters of speculative events plus one derived windowed rate.

Counters are updated after every engine step while a request runs, so dashboards see acceptance move
during long generations. Rates are for PromQL (e.g. rate(verispec_accepted_tokens_total[5m]) /
rate(verispec_draft_tokens_total[5m])); the ``verispec_acceptance_rate_recent`` gauge is the same ratio over
the last ``window_seconds`` computed in-process, for alerting without PromQL (NaN when nothing was drafted).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily

from ..stats import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
MAX_POSITIONS = 16  # per-position series beyond this are folded into the last one


class Metrics:
    def __init__(self, window_seconds: float = 600.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open files (Linux)
        self.requests = Counter("verispec_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.queue_timeouts = Counter("verispec_queue_timeouts", "Requests answered 503 after --queue-timeout "
                                      "without a free slot", registry=r)
        self.request_timeouts = Counter("verispec_request_timeouts", "Generations stopped at --request-timeout",
                                        registry=r)
        self.disconnects = Counter("verispec_client_disconnects", "Generations stopped because the client left",
                                   registry=r)
        self.drafts = Counter("verispec_drafts", "Verify steps that carried at least one draft token",
                              ["drafter"], registry=r)
        self.draft_tokens = Counter("verispec_draft_tokens", "Draft tokens proposed and verified", ["drafter"],
                                    registry=r)
        self.accepted_tokens = Counter("verispec_accepted_tokens", "Draft tokens accepted", ["drafter"], registry=r)
        self.drafted_by_position = Counter("verispec_draft_tokens_by_position",
                                           "Draft tokens verified at draft position i", ["position"], registry=r)
        self.accepted_by_position = Counter("verispec_accepted_tokens_by_position",
                                            "Draft tokens accepted at draft position i", ["position"], registry=r)
        self.verify_steps = Counter("verispec_verify_steps", "Target forward passes after prefill", ["drafter"],
                                    registry=r)
        self.generated_tokens = Counter("verispec_generated_tokens", "Tokens committed by the target", registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.request_latency = Histogram("verispec_request_duration_seconds", "Generation time per request",
                                         ["endpoint"], buckets=REQUEST_BUCKETS, registry=r)
        self.first_token = Histogram("verispec_time_to_first_token_seconds", "Queue wait + prefill + first step",
                                     buckets=REQUEST_BUCKETS, registry=r)
        self.token_latency = Histogram("verispec_token_latency_seconds",
                                       "Per-token latency: a step's time shared by the tokens it committed",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("verispec_queue_depth", "Requests waiting for a generation slot", registry=r)
        self.running = Gauge("verispec_running_requests", "Requests generating now", registry=r)
        self.speculation = Gauge("verispec_speculation_enabled", "1 when speculation is on server-wide",
                                 registry=r)
        self.window_seconds = window_seconds
        recent = Gauge("verispec_acceptance_rate_recent",
                       f"Accepted / drafted tokens over the last {window_seconds:g} s (NaN if nothing drafted)",
                       registry=r)
        recent.set_function(self.recent_acceptance)
        self._window: deque[tuple[float, int, int]] = deque()
        self._lock = threading.Lock()

    def watch_batch(self, engine) -> None:
        """Export a batch engine's raw counters (batch size = sequences / passes, tokens per pass = tokens /
        passes, speculation share = speculating / sequences: derive them with rate() in PromQL) and its
        current size."""
        self.registry.register(_BatchCollector(engine))
        Gauge("verispec_batch_size", "Requests holding a KV cache in the batch now (decoding or prefilling)",
              registry=self.registry).set_function(lambda: engine.size)

    def recent_acceptance(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._window and self._window[0][0] < now - self.window_seconds:
                self._window.popleft()
            drafted = sum(d for _, d, _ in self._window)
            accepted = sum(a for _, _, a in self._window)
        return accepted / drafted if drafted else float("nan")

    def observe_steps(self, stats: GenerationStats, start: int) -> int:
        """Count the steps ``stats`` recorded from index ``start`` on; returns the next index."""
        end = len(stats.step_tokens)
        drafter = stats.drafter
        for j in range(start, end):
            drafted, accepted = stats.step_drafted[j], stats.step_accepted[j]
            committed, seconds = stats.step_tokens[j], stats.step_seconds[j]
            self.verify_steps.labels(drafter).inc()
            if drafted:
                self.drafts.labels(drafter).inc()
                self.draft_tokens.labels(drafter).inc(drafted)
                self.accepted_tokens.labels(drafter).inc(accepted)
                for i in range(1, drafted + 1):
                    self.drafted_by_position.labels(str(min(i, MAX_POSITIONS))).inc()
                for i in range(1, accepted + 1):
                    self.accepted_by_position.labels(str(min(i, MAX_POSITIONS))).inc()
                with self._lock:
                    self._window.append((time.monotonic(), drafted, accepted))
            if committed:
                self.generated_tokens.inc(committed)
                for _ in range(committed):
                    self.token_latency.observe(seconds / committed)
        return end


class _BatchCollector:
    """The batch engine's counters, read when Prometheus scrapes."""

    FIELDS = (
        ("passes", "Batched decode passes of the target"),
        ("sequences", "Sequences decoding, summed over passes (divide by passes: mean batch size)"),
        ("tokens", "Tokens fed (pending + draft), summed over passes (divide by passes: tokens per pass)"),
        ("computed", "Tokens computed including padding, summed over passes"),
        ("speculating", "Sequences that verified at least one draft token, summed over passes (divide by "
                        "sequences: speculation share)"),
        ("prefill_passes", "Prefill passes (whole prompts or chunks)"),
        ("prefill_tokens", "Prompt tokens prefilled"),
        ("reused_prompt_tokens", "Prompt tokens copied from another sequence's cache instead of prefilled (a shared "
                                 "prefix such as a system prompt)"),
        ("seconds", "Seconds spent in batched decode passes"),
    )

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        counters = self.engine.counters
        for name, doc in self.FIELDS:
            family = CounterMetricFamily(f"verispec_batch_{name}", doc)
            family.add_metric([], getattr(counters, name))
            yield family

    def describe(self):
        return []
