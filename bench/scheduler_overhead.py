"""Scheduler overhead per decoding step: decision + telemetry read + cost update, with the
background sampler running (the number in README / docs/notes/2026-11-30-to-12-02-measurements.md).

    python bench/scheduler_overhead.py
"""
import time, numpy as np
from dspark_edge.scheduler import CostModel, Scheduler
from dspark_edge.telemetry import Sampler, SystemReader
curve = {1: 33.6, 2: 40.2, 3: 39.3, 4: 41.5, 6: 43.7, 8: 50.2}
sched = Scheduler(CostModel(curve, 8.0), tuple(curve))
sampler = Sampler(SystemReader())
rng = np.random.default_rng(0)
confs = [np.clip(rng.random(7) * 0.5 + 0.5, 0, 1) for _ in range(64)]
n = 20000
t = time.perf_counter()
for i in range(n):
    snap = sampler.latest
    if sched.wants_draft(snap):
        sched.decide(confs[i % 64], snap)
    sched.observe(4, 41.0)
print(f"scheduler + telemetry read: {(time.perf_counter() - t) / n * 1e3:.4f} ms per step over {n} steps")
t = time.perf_counter()
for _ in range(n):
    sampler.latest
print(f"telemetry read alone: {(time.perf_counter() - t) / n * 1e6:.3f} us")
r = SystemReader(); t = time.perf_counter()
for _ in range(200): r.read()
print(f"one background sample (SystemReader.read): {(time.perf_counter() - t) / 200 * 1e3:.3f} ms")
sampler.close()
