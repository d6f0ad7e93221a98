"""A simulated SGLang 0.5.23 engine: one engine model, two shells.

* :mod:`engines.sim.latency` — roofline forward-pass time with CUDA-graph coverage (pure);
* :mod:`engines.sim.core` — SGLang's scheduler semantics over a KV pool and radix cache (pure, clock passed in);
* :mod:`engines.sim.radix` — the prefix cache with LRU eviction;
* :mod:`engines.sim.args` — SGLang's command line and derived defaults, shared by both shells;
* :mod:`engines.sim.calibration` — published anchors, the efficiency fit, closed-loop TTFT runs;
* :mod:`engines.sim.calibration_file` — measured efficiencies from ``bench/gpu_check.py`` (``--sim-calibration``);
* the real-time HTTP shell (``python -m engines.sim``): :mod:`~engines.sim.realtime` (engine loop),
  :mod:`~engines.sim.server` (native routes, app), :mod:`~engines.sim.openai_api`,
  :mod:`~engines.sim.protocol`, :mod:`~engines.sim.pd_http` (the PD KV hand-off between engine processes);
  the virtual-time shell is :mod:`loadgen.virtual`.
"""
