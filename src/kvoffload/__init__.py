"""kvoffload: LLM inference with the KV cache offloaded to host memory (JAX/Pallas)."""

__version__ = "0.1.0"
