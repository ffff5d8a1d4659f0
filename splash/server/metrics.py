"""Prometheus metrics of the server (``GET /metrics``), on a registry of their own.

Counters and the step-time histogram are updated by the engine thread; the engine's *state* (layout, switches,
KV, requests, prefix cache, weight bytes, the cost-model scheduler's predictions and decisions) is read from the
latest ``EngineSnapshot`` when the registry is scraped, so a scrape never touches the engine. The names are
listed in the README.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splash.config.serve_config import LAYOUTS
from splash.engine.layout_policy.auto import VERDICTS

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a request's latencies: from milliseconds (a cached prompt) to the minutes of a long prompt behind a queue
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                   1800.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


def _family(kind: type, name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    fam = kind(name, doc, labels=labels)
    for key, value in rows:
        fam.add_metric(key, float(value))
    return fam


def _per_rank(name: str, doc: str, values: Iterable[tuple[int, int]]) -> Metric:
    return _family(GaugeMetricFamily, name, doc, ["rank"], (([str(r)], n) for r, n in values))


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], object]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if s is None:
            return
        yield _family(GaugeMetricFamily, "splash_current_layout", "1 for the attention layout in use, 0 otherwise",
                      ["layout"], (([lay], lay == s.layout) for lay in LAYOUTS))
        yield _family(CounterMetricFamily, "splash_layout_switches", "Layout switches executed, by source and "
                      "destination", ["src", "dst"], (([a, b], n) for (a, b), n in sorted(s.switch_counts.items())))
        yield _family(GaugeMetricFamily, "splash_kv_capacity_tokens", "Distinct KV tokens the pool holds in each "
                      "layout", ["layout"], (([lay], n) for lay, n in sorted(s.kv_capacity.items())))
        yield GaugeMetricFamily("splash_kv_used_tokens", "KV tokens held by live requests", value=s.kv_used_tokens)
        yield _per_rank("splash_kv_used_blocks", "KV pages in use on each rank", enumerate(s.kv_used_blocks))
        yield GaugeMetricFamily("splash_kv_blocks_per_rank", "KV pages per rank", value=s.kv_blocks_per_rank)
        yield _per_rank("splash_weight_bytes", "Bytes of weight tensors held by each rank (measured)",
                        sorted(s.weight_bytes.items()))
        yield CounterMetricFamily("splash_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_queries)
        yield CounterMetricFamily("splash_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_hits)
        yield _per_rank("splash_prefix_cache_blocks", "KV pages the prefix cache holds on each rank (in use or "
                        "evictable)", enumerate(s.prefix_cached_blocks))
        yield GaugeMetricFamily("splash_requests_running", "Requests in the running batch", value=s.running)
        yield GaugeMetricFamily("splash_requests_waiting", "Requests queued for admission", value=s.waiting)
        if s.scheduler is not None:
            yield from _scheduler_metrics(s.scheduler)


def _gauges(names: dict[str, tuple[str, str]], labels: list[str],
            rows: Iterable[tuple[list[str], dict]]) -> Iterator[Metric]:
    """One gauge family per ``names`` key, a series per row; a value None is NaN (every series exists from the
    start, so scrapes do not grow)."""
    fams = {k: GaugeMetricFamily(n, h, labels=labels) for k, (n, h) in names.items()}
    for key, values in rows:
        for k, fam in fams.items():
            fam.add_metric(key, float("nan") if values.get(k) is None else float(values[k]))
    yield from fams.values()


def _scheduler_metrics(sch: dict) -> Iterator[Metric]:
    names = {"predicted": ("splash_predicted_step_seconds", "Cost-model prediction (corrected) of the last "
                           "executed step in each layout"),
             "last_measured_s": ("splash_measured_step_seconds", "Measured time of the last executed step in each "
                                 "layout"),
             "factor": ("splash_cost_model_factor", "Online correction factor (measured / predicted) per layout"),
             "median_error": ("splash_prediction_error_ratio", "Median |predicted - measured| / measured per layout")}
    rows = [([lay], {**m, "predicted": None if m["last_predicted_s"] is None
                     else m["last_predicted_s"] * m["factor"]}) for lay, m in sorted(sch["model"].items())]
    yield from _gauges(names, ["layout"], rows)
    yield _family(CounterMetricFamily, "splash_layout_decisions", "Scheduler decisions at step boundaries, by "
                  "verdict", ["verdict"], (([v], sch["decisions"].get(v, 0)) for v in VERDICTS))
    names = {"last_corrected_s": ("splash_switch_predicted_seconds", "Corrected predicted cost of the last "
                                  "switch in each direction"),
             "last_measured_s": ("splash_switch_measured_seconds", "Measured added time of the last switch step"),
             "ratio": ("splash_switch_cost_factor", "Online correction (measured / predicted) of the switch cost"),
             "median_error": ("splash_switch_prediction_error_ratio", "Median |predicted - measured| / measured "
                              "of the switch cost")}
    directions = (sch.get("switch_cost") or {}).get("directions") or {}
    yield from _gauges(names, ["src", "dst"], ((key.split("->"), m) for key, m in sorted(directions.items())))


class Metrics:
    def __init__(self, snapshot: Callable[[], object]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.generated_tokens = Counter("splash_generated_tokens", "Tokens sampled by the engine", registry=r)
        self.prompt_tokens = Counter("splash_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.steps = Counter("splash_engine_steps", "Engine steps executed", registry=r)
        self.requests = Counter("splash_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.step_time = Histogram("splash_step_duration_seconds", "Wall time of one engine step (all ranks)",
                                   buckets=STEP_BUCKETS, registry=r)
        self.ttft = Histogram("splash_time_to_first_token_seconds", "From a sequence's arrival at the engine to "
                              "its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("splash_e2e_request_latency_seconds", "From a sequence's arrival to its last token "
                             "(finished sequences)", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("splash_time_per_output_token_seconds", "A finished sequence's mean time between its "
                              "tokens after the first", buckets=TOKEN_GAP_BUCKETS, registry=r)
        r.register(_StateCollector(snapshot))

    def count_unrouted(self, status: int) -> None:
        """An answer the HTTP protocol wrote before any route was read (splash.server.http)."""
        self.requests.labels("other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
