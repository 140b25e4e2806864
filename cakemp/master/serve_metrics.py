"""`cakemp serve`'s /metrics: what its requests cost, in Prometheus' text format (prometheus.py).

Requests running and waiting, and where the step loop's time went (its StepTimes), are read from
the step loop when scraped; time to first token (from
the request's arrival, its wait included) and each later token's latency are observed as each
token is sampled, so a long stream shows while it runs; completion tokens are counted as they come
(their rate is tokens/s), a request's prompt tokens once it ends, and every error answer by its
HTTP status.
"""

from __future__ import annotations

from collections.abc import Callable

from cakemp.master.step_loop import StepTimes
from cakemp.prometheus import CONTENT_TYPE, Counter, Histogram, Sampled

# A first token waits for its prompt's prefill, and its queue: milliseconds to minutes.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServeMetrics:
    """The serving figures; `running`, `waiting` and `spent` read the step loop's."""

    content_type = CONTENT_TYPE

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int], spent: StepTimes) -> None:
        self.running = Sampled("cakemp_serve_requests_running", "Requests the step loop is generating.", "gauge",
                               running)
        self.waiting = Sampled("cakemp_serve_requests_waiting", "Requests waiting for a place in the step loop.",
                               "gauge", waiting)
        self.steps = _spent(spent, "steps", "Steps of the step loop.")
        self.loop_seconds = _spent(spent, "loop", "Seconds the step loop ran (requests running or waiting); "
                                                  "local_layers, head and workers are parts of it.")
        self.local_layers_seconds = _spent(spent, "local_layers", "Seconds of the step loop in the master's own layers.")
        self.head_seconds = _spent(spent, "head", "Seconds of the step loop in the final norm, lm_head and sampling.")
        self.workers_seconds = _spent(spent, "workers",
                                      "Seconds of the step loop from sending a remote run's Batches to its last reply.")
        self.first_token = Histogram("cakemp_serve_time_to_first_token_seconds",
                                     "Seconds from a request's arrival to its first token.",
                                     buckets=FIRST_TOKEN_BUCKETS)
        self.token_latency = Histogram("cakemp_serve_token_latency_seconds",
                                       "Seconds between a request's consecutive tokens.", buckets=TOKEN_BUCKETS)
        self.completion_tokens = Counter("cakemp_serve_completion_tokens_total", "Tokens generated.")
        self.prompt_tokens = Counter("cakemp_serve_prompt_tokens_total", "Prompt tokens of the requests served.")
        self.errors = Counter("cakemp_serve_errors_total", "Error answers, by HTTP status.", ["status"])

    def token(self, seconds: float, first: bool) -> None:
        """A token sampled `seconds` after its request arrived (`first`) or after its previous token."""
        (self.first_token if first else self.token_latency).observe(seconds)
        self.completion_tokens.inc()

    def render(self) -> str:
        metrics = (self.running, self.waiting, self.first_token, self.token_latency, self.completion_tokens,
                   self.prompt_tokens, self.errors, self.steps, self.loop_seconds, self.local_layers_seconds,
                   self.head_seconds, self.workers_seconds)
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"


def _spent(spent: StepTimes, part: str, documentation: str) -> Sampled:
    """A counter read from `spent`'s `part`: cakemp_serve_steps_total, else cakemp_serve_<part>_seconds_total."""
    name = "cakemp_serve_steps_total" if part == "steps" else f"cakemp_serve_{part}_seconds_total"
    return Sampled(name, documentation, "counter", lambda: getattr(spent, part))
