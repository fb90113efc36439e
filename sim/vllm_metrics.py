"""The emulated GPU's Prometheus exposition, under vLLM's metric names.

Both kinds of emulated GPU server (V2 gRPC with metrics on their own port, OpenAI
HTTP with ``/metrics`` on the API port, as vLLM does) write the same text, so the
local tier scrapes either exactly as it would scrape a real vLLM.
"""

from __future__ import annotations

from common.config.gpu import GpuConfig
from sim.engine import GpuEngine

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, EngineStats attribute); all carry a model_name label.
_METRICS = (
    ("vllm:num_requests_running", "gauge", "Requests in the running batch.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting for KV cache or a slot.", "waiting"),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "Fraction of KV cache reserved (0..1).",
        "kv_cache_usage",
    ),
    ("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.", "prompt_tokens_total"),
    ("vllm:generation_tokens_total", "counter", "Tokens generated.", "tokens_generated_total"),
    (
        "vllm:request_success_total",
        "counter",
        "Requests finished successfully.",
        "requests_succeeded_total",
    ),
    (
        "meridian_sim_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        "prefix_cache_hit_tokens",
    ),
)


def metrics_text(gpu: GpuConfig, engine: GpuEngine) -> str:
    """The Prometheus exposition of ``gpu``'s engine, one series per model."""
    per_model = {model: engine.stats(model) for model in gpu.models}
    lines = []
    for name, kind, help_text, attr in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for model, stats in per_model.items():
            value = getattr(stats, attr)
            lines.append(f'{name}{{model_name="{_label(model)}"}} {value}')
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
