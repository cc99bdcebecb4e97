"""Measured stage costs: each candidate layer range compiled and timed on a real submesh.

The step's program with one stage and two microbatches holds, in its first
forward and backward tasks, every operation of one microbatch. The operations of
layers ``i..j`` are cut out of those two tasks into one executable, compiled on
``n`` devices with the batch split over them, and timed (median of several runs
after warm-up). Times are cached on disk (:mod:`autopar._src.measure`), keyed by
the executable's jaxpr, mesh, shardings and device kind, so planning again does
not profile again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._src import cost, measure, partition
from autopar._src.driver import DATA_AXIS
from autopar._src.interpret import task_fn
from autopar._src.plan import Plan, StagePlan
from autopar._src.program import Key, Op, Task
from autopar._src.trace import TracedStep

NUM_MICROBATCHES = 2
"""Microbatches of the program the layers are cut from (two, so tasks are not fused)."""


def _layer_of(step: TracedStep, num_layers: int) -> dict[int, int]:
    at = step.region_index()
    rj = step.jaxpr.eqns[at].params["info"].jaxpr
    placement = partition.region_eqn_placement(rj, tuple(range(num_layers)))
    return {id(e): layer for e, (layer, _) in zip(rj.eqns, placement, strict=True)}


def _range_task(
    tasks: Sequence[Task], all_ops: Sequence[Op], layer_of: dict[int, int], start: int, stop: int
) -> Task:
    """The ops of layers ``start..stop-1`` from microbatch 0's forward and backward: the loss
    function's (the code before it that the forwards run is priced by its FLOPs,
    :attr:`~autopar._src.profile.LayerProfile.before_flops`)."""
    chosen = [
        op
        for t in tasks
        for op in t.ops
        if op.kind == "eqn" and id(op.eqn) in layer_of and start <= layer_of[id(op.eqn)] < stop
    ]
    made = {k for op in chosen for k in op.outs if k is not None}
    ins: list[Key] = []
    for op in chosen:
        for k in op.ins:
            if isinstance(k, tuple) and k not in made and k not in ins:
                ins.append(k)
    chosen_ids = {id(op) for op in chosen}
    read_elsewhere = {k for op in all_ops if id(op) not in chosen_ids for k in op.ins if isinstance(k, tuple)}
    outs = tuple(
        k for k in dict.fromkeys(k for op in chosen for k in op.outs if k is not None) if k in read_elsewhere
    )
    return Task(
        stage=0,
        label=f"layers {start}-{stop - 1}",
        ops=chosen,
        repeated=False,
        in_keys=tuple(ins),
        out_keys=outs,
    )


def _spec(key: Key, rows: int, n: int) -> PartitionSpec:
    if (
        isinstance(key[1], int)
        and not isinstance(key[1], bool)
        and cost.splits_over_batch(key[0].aval, rows)
        and rows % n == 0
    ):
        return PartitionSpec(DATA_AXIS)
    return PartitionSpec()


def _example(aval: Any, sharding: NamedSharding) -> Any:
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(0), int(np.prod(aval.shape)) or 1)
        return jax.device_put(keys[: int(np.prod(aval.shape))].reshape(aval.shape), sharding)
    return jax.device_put(jnp.zeros(aval.shape, aval.dtype), sharding)


def layer_range_latency(
    step: TracedStep,
    batch_ids: Sequence[int],
    microbatch_size: int,
    devices: Sequence[Any],
    submesh_sizes: Sequence[int],
    *,
    cache: measure.CostCache | None,
    progress: bool = False,
) -> np.ndarray:
    """Measured seconds of one microbatch's forward+backward of every layer range on
    data-parallel submeshes of ``submesh_sizes`` devices: an array ``[start, last, k]``
    (``inf`` below the diagonal)."""
    info = step.jaxpr.eqns[step.region_index()].params["info"]
    num_layers = len(info.cuts) + 1
    plan = Plan(
        num_microbatches=NUM_MICROBATCHES,
        schedule="gpipe",
        cuts=info.cuts,
        layer_flops=info.layer_flops,
        stages=(
            StagePlan(
                layers=(0, num_layers),
                device_ids=(0,),
                mesh_shape=(1,),
                axis_names=(DATA_AXIS,),
                forward_flops=0.0,
            ),
        ),
    )
    program = partition.build_program(step, plan, batch_ids, microbatch_size)
    first = [t for t in program.tasks if t.label in ("F0.0", "B0.0")]
    all_ops = [op for t in program.tasks for op in t.ops]
    layer_of = _layer_of(step, num_layers)
    latency = np.full((num_layers, num_layers, len(submesh_sizes)), np.inf)
    items = []
    for k, n in enumerate(submesh_sizes):
        mesh = Mesh(np.array(devices[:n]), (DATA_AXIS,))
        for start in range(num_layers):
            for stop in range(start + 1, num_layers + 1):
                task = _range_task(first, all_ops, layer_of, start, stop)
                in_sh = [NamedSharding(mesh, _spec(key, microbatch_size, n)) for key in task.in_keys]
                out_sh = [NamedSharding(mesh, _spec(key, microbatch_size, n)) for key in task.out_keys]
                fn = jax.jit(task_fn(task, {}), in_shardings=tuple(in_sh), out_shardings=tuple(out_sh))
                abstract = [
                    jax.ShapeDtypeStruct(key[0].aval.shape, key[0].aval.dtype, sharding=sh)
                    for key, sh in zip(task.in_keys, in_sh, strict=True)
                ]
                cost_key = measure.CostKey(
                    jaxpr_hash=measure.hash_jaxpr(jax.make_jaxpr(fn)(*abstract)),
                    mesh_shape=(n,),
                    axis_names=(DATA_AXIS,),
                    shardings=tuple(str(sh.spec) for sh in in_sh),
                    device_kind=devices[0].device_kind,
                )
                items.append(((start, stop - 1, k), fn, abstract, cost_key))
    args_cache: dict[int, list[Any]] = {}

    def args_for(i: int) -> list[Any]:
        if i not in args_cache:
            args_cache[i] = [_example(a, a.sharding) for a in items[i][2]]
        return args_cache[i]

    for i, (where, fn, _, cost_key) in enumerate(items):
        cached = cache.get(cost_key) if cache is not None else None
        latency[where] = (
            cached if cached is not None else measure.measure(fn, args_for(i), key=cost_key, cache=cache)
        )
    return latency
