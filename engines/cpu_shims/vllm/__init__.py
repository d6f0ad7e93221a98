"""A stand-in ``vllm`` package for running real SGLang on CPU in tests (see ../README.md); not vLLM."""
