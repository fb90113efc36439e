"""Meridian beside the field's LLM routers: the same emulated GPUs, the same arrivals.

The same emulated OpenAI GPUs (one ``meridian worker`` process) behind six fronts:
Meridian's whole chain, Meridian's local tier alone with its own OpenAI edge, a real
Envoy carrying the bytes with that local tier as its endpoint picker (ext_proc), and SMG,
sglang-router and vllm-router from PyPI (``fronts``). Chat completions with shared system
prompts and multi-turn conversations, streamed and unary, arrive open-loop at a fixed
share of the GPUs' capacity (``workload``), sent by one client (``client``) to each front
in turn, the order rotated per round (``run``). Per front: CPU per request and per output
token of every process of the front, TTFT, time per output token, end-to-end P50/P99 with
failures counted as infinitely late, errors by kind (``stats``); ratios to the best Rust
router of the same round (``report``). ``python -m bench.field_routers`` runs it.
"""
