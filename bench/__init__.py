"""PagedServe's benchmark suites: `python -m bench <suite>` (see docs/benchmarks.md).

Suites: throughput (offline, optionally against Hugging Face and vLLM), serve
(online latency under Poisson arrivals), memory (KV waste and concurrency,
paged vs reserve-the-maximum), prefix (shared system prompt, cache on vs off).
Every suite drives real engine processes through the public gRPC API only.
"""
