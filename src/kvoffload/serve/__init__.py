"""Serving: continuous batching over a paged device cache with prefix reuse, and an OpenAI-compatible HTTP API.

scheduler.py (requests, admission, the step), blocks.py (host bookkeeping: allocator, reference counts, the
prefix cache), cache.py (the device block store and its prefill / decode programs), sampling.py (per-request
sampling in one batch), api.py (the HTTP server). Nothing below this package imports it."""
