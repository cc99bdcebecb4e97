"""The cases of ``cost_model.py``: each model's one-stage step on a submesh with a microbatch
count, ready to measure, and what the analytic cost model predicts for it."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

MODEL_NAMES = ("gpt-tiny", "gpt-small", "mlp", "mlp-wide", "bert-tiny")
LARGE_MODEL_NAMES = ("gpt-350m", "gpt-1.3b", "wresnet-250m", "moe-380m")
"""Published sizes in bfloat16 compute, for accelerators (not in the default list)."""


def model_config(name: str) -> tuple[str, Any]:
    """``(kind, config)`` of a model name of this benchmark."""
    import jax.numpy as jnp

    from models.bert import BertConfig
    from models.gpt import GPTConfig
    from models.mlp import MLPConfig
    from models.moe import MoEConfig
    from models.wide_resnet import WResNetConfig

    configs = {
        "gpt-tiny": ("gpt", GPTConfig.preset("gpt-tiny")),
        "gpt-small": ("gpt", GPTConfig.preset("gpt-small")),
        "mlp": ("mlp", MLPConfig()),
        # Large enough for its matmuls, not dispatch, to dominate the step.
        "mlp-wide": ("mlp", MLPConfig(features=(1024, 1024, 1024), in_features=1024)),
        "bert-tiny": ("bert", BertConfig.preset("bert-tiny")),
        "gpt-350m": ("gpt", GPTConfig.preset("gpt-350m", dtype=jnp.bfloat16)),
        "gpt-1.3b": ("gpt", GPTConfig.preset("gpt-1.3b", dtype=jnp.bfloat16)),
        "wresnet-250m": ("wresnet", WResNetConfig.preset("wresnet-250m", dtype=jnp.bfloat16)),
        "moe-380m": ("moe", MoEConfig.preset("moe-380m", dtype=jnp.bfloat16)),
    }
    if name not in configs:
        raise ValueError(f"Unknown model {name!r}; choose from {sorted(configs)}")
    return configs[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One (model, submesh) measurement and its predictions."""

    model: str
    """Model name."""
    num_devices: int
    """Devices of the submesh."""
    num_microbatches: int
    """Microbatches the stage runs per step (above 1: one task each, forward and backward joined)."""
    label: str
    """Label of the measurement."""
    fn: Any
    """The one-stage autopar step."""
    args: tuple[Any, Any]
    """``(state, batch)`` already placed on the submesh."""
    key: Any
    """Its :class:`CostKey`."""
    predicted: dict[str, float]
    """Predicted seconds per step by spec label."""
    predicted_compute: dict[str, float]
    """The compute part of each prediction (the rest is communication and dispatch)."""


def _predictions(costs: Any, num_layers: int, n: int, spec_name: str) -> tuple[float, float]:
    """Latency and compute of the whole model as one stage on a ``(1, n)`` submesh, logical ``(n, 1)``."""
    if (1, n) not in costs.submeshes:
        raise ValueError(
            f"cluster spec {spec_name!r} has no submesh of {n} devices on one host (it has "
            f"{list(costs.submeshes)}); pass a spec with at least {n} devices per host or fewer --devices"
        )
    k = costs.submeshes.index((1, n))
    q = costs.logical[k].index((n, 1))
    return float(costs.latency[0, num_layers - 1, k, q]), float(costs.compute[0, num_layers - 1, k, q])


def build_cases(
    name: str,
    *,
    device_counts: list[int],
    batch_size: int,
    microbatch_counts: tuple[int, ...] = (1,),
    specs: dict[str, Any],
    runnable: bool = True,
) -> tuple[list[Case], dict[str, Any]]:
    """The measurements of one model and what the profile says about it.

    Without ``runnable`` the state stays abstract and the cases only predict (their ``fn``,
    ``args`` and ``key`` are None): for measurements recorded on other devices.
    """
    import jax
    import optax

    from autopar._src import planner, planning, trace
    from models import train

    kind, config = model_config(name)
    if runnable:
        step, state = train.setup(kind, "linen", config, optax.sgd(0.1))
    else:
        step = train.linen_step(kind)
        state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.sgd(0.1)))
    batch = train.make_batch(kind, config, batch_size)
    num_state = len(jax.tree.leaves(state))
    batch_ids = tuple(range(num_state, num_state + len(jax.tree.leaves(batch))))
    options = trace.TraceOptions(num_layers=None)
    traced = planning.trace_at(step, (state, batch), batch_ids, batch_size, options)
    prof = planning.step_profile(step, (state, batch), batch_ids, batch_size, traced)
    # The profile is of the whole batch; a microbatch is 1/m of it.
    costs = {
        (label, m): planner.stage_costs(
            prof, spec, num_microbatches=m, batch_scale=1 / m, tensor_parallel=False
        )
        for label, spec in specs.items()
        for m in microbatch_counts
    }
    info = {
        "layers": prof.num_layers,
        "gflops": float(prof.forward_flops.sum() + prof.backward_flops.sum()) / 1e9,
        "param_mib": float(prof.param_bytes.sum()) / 2**20,
        "config": config,
    }
    devices = jax.devices()
    cases = []
    for n, m in itertools.product(device_counts, microbatch_counts):
        if batch_size % (n * m):
            raise ValueError(
                f"--batch-size {batch_size} is not divisible by {n} devices x {m} microbatches; "
                "choose a multiple"
            )
        predicted, compute = {}, {}
        for label in specs:
            latency, busy = _predictions(costs[label, m], prof.num_layers, n, specs[label].name)
            # One stage runs its microbatches one after another.
            predicted[label], compute[label] = m * latency, m * busy
        label = f"{name} on {n} device(s), {m} microbatch(es)"
        fn, placed, key = (
            _runnable(step, state, batch, batch_ids, devices[:n], m) if runnable else (None, None, None)
        )
        cases.append(
            Case(
                model=name,
                num_devices=n,
                num_microbatches=m,
                label=label,
                fn=fn,
                args=placed,
                key=key,
                predicted=predicted,
                predicted_compute=compute,
            )
        )
    return cases, info


def _runnable(step: Any, state: Any, batch: Any, batch_ids: tuple[int, ...], devices: Any, m: int) -> Any:
    """``(fn, args, key)`` of the one-stage step of ``m`` microbatches on ``devices``: the autopar
    step, ``(state, batch)`` placed on them, and its cost-cache key."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import autopar
    from autopar._src import measure

    fn = autopar.autoparallel(step, num_stages=1, num_microbatches=m, devices=devices, sharding="data")
    # Building the executable traces the step as it will run (nothing is compiled yet).
    exe = fn.executable(state, batch)
    mesh = Mesh(devices, ("data",))
    placed = (
        jax.device_put(state, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )
    key = measure.CostKey(
        # The step's jaxpr is the same for every microbatch count.
        jaxpr_hash=f"{measure.hash_jaxpr(exe.step.jaxpr)}-{m}",
        mesh_shape=(len(devices),),
        axis_names=("data",),
        shardings=tuple(
            str(P("data")) if i in batch_ids else str(P()) for i in range(len(jax.tree.leaves(placed)))
        ),
        device_kind=str(devices[0].device_kind),
    )
    return fn, placed, key
