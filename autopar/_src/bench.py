"""Step-time measurement of autopar plans against ``jax.jit`` on the same devices."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

JIT = "jax.jit (data parallel)"


def interleaved_times(fns: Mapping[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Times each function once per round, alternating, so background noise hits all alike."""
    import jax

    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return times


def step_times(
    step: Callable[..., Any],
    state: Any,
    batch: Any,
    configs: Mapping[str, dict[str, Any]],
    *,
    rounds: int,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """Step times of ``jax.jit`` (state replicated, batch split over all devices) and of
    autopar with each options dict in ``configs``; every run feeds its own new state back."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from autopar._src.api import autoparallel

    mesh = Mesh(np.array(jax.devices()), ("data",))
    states: dict[str, Any] = {JIT: jax.device_put(state, NamedSharding(mesh, PartitionSpec()))}
    runners: dict[str, tuple[Callable[..., Any], Any]] = {
        JIT: (jax.jit(step), jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data"))))
    }
    for name, options in configs.items():
        states[name] = state
        runners[name] = (autoparallel(step, **options), batch)

    def runner(name: str) -> Callable[[], Any]:
        fn, b = runners[name]

        def run() -> Any:
            states[name], loss = fn(states[name], b)
            return loss

        return run

    fns = {name: runner(name) for name in runners}
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    return interleaved_times(fns, rounds)


def median(ts: list[float]) -> float:
    """Median of ``ts``."""
    return statistics.median(ts)
