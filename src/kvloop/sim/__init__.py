"""Simulation inputs and outputs: request workloads and metrics.

- ``kvloop.sim.traces``: replay real public traces (Azure LLM inference 2023, Mooncake,
  ShareGPT lengths), shipped compressed as package data, or a trace file of the same formats.
- ``kvloop.sim.workloads``: synthetic workloads (Poisson or gamma arrivals, fixed, uniform
  or trace-drawn lengths, priority mixes).
- ``kvloop.sim.driver``: the discrete-event loop (``simulate``: one engine); and
  ``kvloop.sim.cluster``: N replicas behind a router on one timeline (``simulate_cluster``).
- ``kvloop.sim.inference_perf``: the requests and load stages of an inference-perf config.
- ``kvloop.sim.metrics``: TTFT, TPOT, ITL, e2e, queue time, throughput and goodput over
  finished requests, as defined in ARCHITECTURE.md; ``kvloop.sim.stages``: the same per load
  stage, with an overload verdict for each.
"""
