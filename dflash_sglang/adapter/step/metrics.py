"""The goodput controller's Prometheus metrics, beside SGLang's speculative ones (`--enable-metrics`).

SGLang exports `sglang:spec_accept_length`, `sglang:spec_accept_rate` and `sglang:spec_num_draft_tokens` (the last
step's verify rows, read off our worker). What the controller decides and why is ours:

- `sglang:dflash_decode_steps_total{shape}`: decode steps per shape ('1' a plain step, '4' a chain of 4 rows, '8x4' a
  tree of 8 nodes over top-4), counted every step;
- `sglang:dflash_shape_nodes`, `sglang:dflash_shape_topk`: the last step's shape;
- `sglang:dflash_goodput_predicted_tokens_per_second`, `..._plain_tokens_per_second`,
  `..._measured_tokens_per_second`: the chosen shape's predicted committed tokens/s at the current batch size, a plain
  step's, and the measured (forgotten) rate: predicted vs measured shows whether the models hold;
- `sglang:dflash_goodput_accept_rate{depth}` (depths 1-8) and `sglang:dflash_goodput_step_cost_seconds{term}` (the
  cost model's coefficients, core/shape/goodput.py TERMS).

The gauges are refreshed at most once per `every_s` seconds of decoding (a summary evaluates every candidate); the
step counter every step. Gauges are `mostrecent` in SGLang's multiprocess collection, as its own are. Only the TP
rank that decides (rank 0) publishes.
"""
from __future__ import annotations

import time

from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.shape.goodput import TERMS, GoodputController, label

PREFIX = "sglang:dflash_"


class GoodputMetrics:
    def __init__(self, labels: dict[str, str], registry=None, every_s: float = 1.0) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = registry if registry is not None else REGISTRY
        self.labels, self.every_s, self._last = dict(labels), every_s, float("-inf")
        names = list(self.labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labelnames=names + list(extra), multiprocess_mode="mostrecent",
                         registry=registry)

        self.steps = Counter(PREFIX + "decode_steps", "Decode steps per verify shape chosen by the goodput "
                             "controller ('1': a plain step, 'N': a chain of N rows, 'NxK': a tree over top-K).",
                             labelnames=names + ["shape"], registry=registry)
        self.nodes = gauge("shape_nodes", "Verify rows per request of the last decode step (1: a plain step).")
        self.topk = gauge("shape_topk", "Top-k of the last decode step's shape (1: a chain).")
        self.predicted = gauge("goodput_predicted_tokens_per_second",
                               "The goodput controller's predicted committed tokens/s of the best shape.")
        self.plain = gauge("goodput_plain_tokens_per_second", "Predicted committed tokens/s of a plain step.")
        self.measured = gauge("goodput_measured_tokens_per_second", "Measured committed tokens/s (forgotten).")
        self.accept = gauge("goodput_accept_rate", "Acceptance of the drafter's best token by draft depth.",
                            ("depth",))
        self.cost = gauge("goodput_step_cost_seconds", "The step cost model's coefficients.", ("term",))

    def step(self, shape: SpecShape, controller: GoodputController, bs: int) -> None:
        """After every decode step of `shape` over `bs` requests."""
        self.steps.labels(**self.labels, shape=label(shape)).inc()
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        summary = controller.summary(bs)
        self.nodes.labels(**self.labels).set(shape.nodes)
        self.topk.labels(**self.labels).set(shape.topk)
        self.measured.labels(**self.labels).set(summary["measured_tps"])
        for depth, rate in enumerate(summary["accept_rate"], start=1):
            self.accept.labels(**self.labels, depth=str(depth)).set(rate)
        if "predicted_tps" in summary:
            self.predicted.labels(**self.labels).set(summary["predicted_tps"][summary["best"]])
            self.plain.labels(**self.labels).set(summary["predicted_tps"]["1"])
            for term in TERMS:
                self.cost.labels(**self.labels, term=term).set(summary["cost_ms"][term] / 1e3)
