"""Engine processes: the SGLang client side and the simulated SGLang-compatible engine."""
