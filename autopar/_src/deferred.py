"""Gradient all-reduces deferred to the end of the step.

With several microbatches, a weight gradient whose layout finishes partial sums over a mesh
axis (data parallelism's weight-gradient matmul contracts the batch split over ``data``)
would be all-reduced once per microbatch. Instead, the task of each microbatch keeps every
device's partial sum: the equation runs under ``shard_map`` on the local blocks and returns
them stacked along a new leading dim split over the reduced axes, so it issues no collective.
Casts and transposes on the way to the gradient are applied to each partial sum (they are
linear), the accumulator adds stacked partial sums in place, and the once-per-step mean sums
the stacked dim (the one all-reduce) before it divides. Per device the stacked accumulator
holds as many bytes as the reduced one. Megatron-LM and Alpa accumulate the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from autopar._src import compat
from autopar._src.collectives import Axes, Spec, entry_axes
from autopar._src.layout_costs import spec_axes
from autopar._src.program import Key, Task

PARTIAL_SUM_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"})
"""Primitives whose result on local blocks is a partial sum of the result's block when a
contracted (or reduced) dim is split: applied to every device's blocks and summed, they give
the whole result."""
LINEAR_PRIMITIVES = frozenset({"convert_element_type", "transpose", "copy", "copy_p", "reshape"})
"""One-operand primitives that may be applied to each partial sum instead of to their sum."""


def reduced_axes(
    input_specs: Sequence[Spec], output_spec: Spec, axis_names: Sequence[str]
) -> tuple[str, ...]:
    """The mesh axes that split an operand of a partial-sum equation but not its result: those
    over which its local results are partial sums, in mesh order."""
    ins = {a for spec in input_specs for entry in spec for a in entry_axes(entry)}
    out = {a for entry in output_spec for a in entry_axes(entry)}
    return tuple(a for a in axis_names if a in ins and a not in out)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A value kept as one partial sum per device, stacked along a new leading dim."""

    axes: tuple[str, ...]
    """The mesh axes the partial sums are over; the stacked dim is split over them."""
    operand_specs: tuple[Spec, ...] | None = None
    """For the equation that makes the partial sums: its operands' layouts (``None``: the value
    is a linear function of a stacked value)."""

    @property
    def entry(self) -> Axes:
        """The stacked dim's spec entry."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def spec(self, base: Spec) -> PartitionSpec:
        """The spec of the stacked value whose reduced value has spec ``base``."""
        return PartitionSpec(self.entry, *base)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """What one stage keeps as partial sums."""

    values: dict[Any, Stacked]
    """Per-microbatch values (jaxpr variables) made as stacked partial sums."""
    accumulators: dict[Any, Stacked]
    """Gradient-region outputs whose running sums over microbatches are stacked."""


NONE = Deferred({}, {})


def deferred_sums(
    tasks: Sequence[Task], stage: int, partial_sums: Mapping[Any, Any], specs: Mapping[Any, Spec]
) -> Deferred:
    """The gradients of ``stage`` whose reduction can wait for the last microbatch.

    A region output qualifies when its per-microbatch value is made in the task that adds it
    to its accumulator, read by nothing else, by a chain of :data:`LINEAR_PRIMITIVES` from an
    equation whose layout leaves partial sums (``partial_sums``: the sharding ILP's
    :attr:`~autopar._src.intra_op.StageSharding.partial_sums`), each link read only by the next,
    and neither the links nor the region output split over a summed axis (``specs``): a
    gradient laid out that way is reduce-scattered each microbatch, since its stacked sum
    would need more memory than the plan gives it.
    """
    values: dict[Any, Stacked] = {}
    accumulators: dict[Any, Stacked] = {}
    for root, links, total in gradient_chains(tasks, stage, partial_sums.__contains__):
        operand_specs, axes = partial_sums[root]
        if any(set(axes) & spec_axes(specs.get(v, ())) for v in (*links, total)):
            continue  # split over a summed axis on the way: reduce-scatter each microbatch
        values[root] = Stacked(axes, operand_specs)
        values.update((v, Stacked(axes)) for v in links)
        accumulators[total] = Stacked(axes)
    return Deferred(values, accumulators)


def gradient_chains(
    tasks: Sequence[Task], stage: int, is_partial: Callable[[Any], bool]
) -> list[tuple[Any, list[Any], Any]]:
    """``(root, links, region output)`` of every gradient of ``stage`` that is made as partial
    sums: ``root`` by an equation of :data:`PARTIAL_SUM_PRIMITIVES` (for which ``is_partial``
    holds), ``links`` by linear equations from it, the last one the region output's value."""
    chains = []
    for task in tasks:
        if task.stage != stage:
            continue
        made: dict[Key, Any] = {}
        reads: dict[Key, int] = {k: 1 for k in task.out_keys}
        for op in task.ops:
            for k in op.ins:
                if isinstance(k, tuple):
                    reads[k] = reads.get(k, 0) + 1
            for k in op.outs:
                if k is not None:
                    made[k] = op
        for op in task.ops:
            if op.kind != "acc" or op.mode != "add":
                continue
            chain = _partial_chain(op.ins[1], made, reads, is_partial)
            if chain is not None:
                chains.append((chain[0], chain[1:], op.outs[0][0]))
    return chains


def _partial_chain(
    key: Any, made: dict[Key, Any], reads: dict[Key, int], is_partial: Callable[[Any], bool]
) -> list[Any] | None:
    """Variables from a partial-sum equation's result to ``key``'s, or None."""
    chain: list[Any] = []
    while isinstance(key, tuple) and key in made and reads.get(key, 0) == 1:
        op = made[key]
        if op.kind != "eqn" or len(op.outs) != 1:
            return None
        chain.append(key[0])
        name = op.eqn.primitive.name
        if name in PARTIAL_SUM_PRIMITIVES and is_partial(key[0]):
            return chain[::-1]
        if name not in LINEAR_PRIMITIVES or len(op.ins) != 1:
            return None
        key = op.ins[0]
    return None


def bind(eqn: Any, vals: list[Any], stacked: Stacked, out_spec: Spec, mesh: Mesh) -> Any:
    """``eqn`` applied to ``vals``, as stacked partial sums."""
    if stacked.operand_specs is None:  # a linear function of one stacked value
        return jax.vmap(lambda x: compat.bind_eqn(eqn, [x])[0])(vals[0])

    def local(*xs: Any) -> Any:
        return compat.bind_eqn(eqn, list(xs))[0][None]

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(PartitionSpec(*s) for s in stacked.operand_specs),
        out_specs=stacked.spec(out_spec),
        check_vma=False,
    )(*[jnp.asarray(v) for v in vals])


def zeros(aval: Any, stacked: Stacked | None, mesh: Mesh) -> Any:
    """The start of a running sum: zeros of ``aval``, stacked when the sum is."""
    if stacked is None:
        return jnp.zeros(aval.shape, aval.dtype)
    n = 1
    for a in stacked.axes:
        n *= mesh.shape[a]
    return jnp.zeros((n, *aval.shape), aval.dtype)


def finish(total: Any, stacked: Stacked | None) -> Any:
    """The reduced value of a running sum: the stacked partial sums added up."""
    return total if stacked is None else jnp.sum(total, axis=0)
