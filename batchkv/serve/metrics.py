"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own.

Written by the engine thread (prometheus_client's metrics are thread-safe), read by the HTTP
thread. Latencies are seconds measured on the server: time to first token runs from the moment
the HTTP request was parsed to the step that produced the sample's first token; inter-token
latency is the gap between two consecutive tokens of one sample.

Beside batchkv's own names, the gauges an inference gateway routes by, under the names of the
Gateway API Inference Extension's model-server protocol (its endpoint picker reads vLLM's by
default): `vllm:num_requests_waiting` (TotalQueuedRequests), `vllm:num_requests_running`
(TotalRunningRequests), `vllm:kv_cache_usage_perc` (KVCacheUtilization: a fraction, 0 to 1, of the
store's positions that live requests hold; what the prefix cache keeps counts as free, as vLLM counts
its cached blocks) and `vllm:cache_config_info` (block_size: the prefix index's 16-token block;
num_gpu_blocks: the store's positions in such blocks).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from batchkv.executor.prefix import BLOCK

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    """Gauges of the engine's state, token counters and latency histograms."""

    def __init__(self, max_seqs: int) -> None:
        disable_created_metrics()  # no `_created` series: timestamps nobody graphs
        r = self.registry = CollectorRegistry()
        self.running = Gauge("batchkv_requests_running", "Requests prefilling or decoding", registry=r)
        self.waiting = Gauge("batchkv_requests_waiting", "Requests queued for columns", registry=r)
        self.columns = Gauge("batchkv_kv_columns_in_use", "KV cache columns held by live requests", registry=r)
        self.cached_columns = Gauge("batchkv_kv_columns_cached", "KV cache columns the prefix cache keeps", registry=r)
        self.positions = Gauge("batchkv_kv_positions_in_use", "KV positions live requests hold", registry=r)
        self.positions_total = Gauge("batchkv_kv_positions_total", "KV positions the store holds", registry=r)
        # The model-server protocol's gauges (Gateway API Inference Extension), under vLLM's names.
        self.gateway_waiting = Gauge("vllm:num_requests_waiting", "Requests queued for columns", registry=r)
        self.gateway_running = Gauge("vllm:num_requests_running", "Requests prefilling or decoding", registry=r)
        self.gateway_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of the store's KV positions live requests hold (1: full)", registry=r
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info", "KV cache geometry", ["block_size", "num_gpu_blocks"], registry=r
        )
        Gauge("batchkv_kv_columns_total", "KV cache columns (max_seqs)", registry=r).set(max_seqs)
        self.generated = Counter("batchkv_generation_tokens", "Tokens generated", registry=r)
        self.prompted = Counter("batchkv_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.cached = Counter("batchkv_prompt_tokens_cached", "Prompt tokens reused from the prefix cache", registry=r)
        self.captures = Counter("batchkv_graph_captures", "CUDA graphs captured", registry=r)
        self.finished = Counter(
            "batchkv_request_samples_finished",
            "Samples finished, by the finish_reason the client sees (stop, length, abort, timeout)",
            ["reason"],
            registry=r,
        )
        self.refused = Counter("batchkv_requests_refused", "HTTP requests refused, by status", ["status"], registry=r)
        self.ttft = Histogram(
            "batchkv_time_to_first_token_seconds", "Request arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "batchkv_inter_token_latency_seconds",
            "Gap between token arrivals of one sample (per verify step when speculating)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._captures_seen = 0
        self._total_seen = -1

    def observe_engine(
        self, *, running: int, waiting: int, columns: int, cached: int, captures: int, positions: tuple[int, int]
    ) -> None:
        """The engine's state after a step or a command (engine thread); `positions`: (held by live
        requests, the store's), as `Engine.kv_usage` gives them."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.gateway_running.set(running)
        self.gateway_waiting.set(waiting)
        held, total = positions
        self.positions.set(held)
        self.gateway_usage.set(held / total if total else 0.0)
        if total != self._total_seen:  # fixed for an engine's life: one info series
            self.positions_total.set(total)
            self.cache_info.clear()
            self.cache_info.labels(str(BLOCK), str(total // BLOCK)).set(1)
            self._total_seen = total
        self.columns.set(columns)
        self.cached_columns.set(cached)
        if captures > self._captures_seen:
            self.captures.inc(captures - self._captures_seen)
            self._captures_seen = captures

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` `count` times, in one update: the bucket `observe` would count
    `value` in gains `count`, the sum `value * count` (prometheus_client's own fields, which
    `observe` writes; a histogram without them is observed `count` times)."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break
