"""A simulated SGLang-compatible engine: latency model, pure batching core, HTTP shell (``python -m engines.sim``)."""
