"""Memory traffic of memory-bound equations, as XLA's fusion leaves it.

XLA fuses chains of elementwise, broadcasting, reshaping and reducing equations into loops
that keep their intermediates in registers: a value is written to device memory only when
something that cannot fuse it reads it (a matmul or convolution, a gather or scatter, a
sort) or when it leaves the task that makes it (a stage output, a value the backward
stashes, a gradient). Each value written is read back once. Charging every equation's
output instead counts 364 GB for a GPT-350M step of 8 x 1024 tokens, more than twice what an
H200 can move (2.17 TB/s) in the 70.5 ms the whole step was measured to take; this rule counts
114 GB.

Heavy equations (those with FLOPs: ``dot_general``, convolutions) are priced by their FLOPs
(:mod:`autopar._src.cost`) and charged no traffic here. The rule works on the strategy
graph's flat equations (:class:`~autopar._src.strategy_graph.GraphOp`, calls and loops
expanded by :func:`~autopar._src.expansion.expand_calls`), so the analytic profile and the
sharding ILP price the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autopar._src import compat, cost
from autopar._src.strategies import ELEMENTWISE_PRIMITIVES, REDUCTION_PRIMITIVES, elementwise_call

if TYPE_CHECKING:  # strategy_graph prices its nodes with this module
    from autopar._src.strategy_graph import GraphOp

FUSIBLE_PRIMITIVES: frozenset[str] = (
    ELEMENTWISE_PRIMITIVES
    | REDUCTION_PRIMITIVES
    | frozenset(
        "broadcast_in_dim reshape squeeze expand_dims transpose rev iota slice pad concatenate "
        "dynamic_slice".split()
    )
)
"""Equations XLA fuses with what produces their operands (duplicating cheap producers)."""
EXPENSIVE_PRIMITIVES: frozenset[str] = frozenset(
    "acos acosh asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt cos cosh digamma div erf "
    "erf_inv erfc exp exp2 expm1 igamma igamma_grad_a igammac lgamma log log1p log2 logistic "
    "polygamma pow rem rsqrt sin sinh sqrt tan tanh zeta".split()
)
"""Elementwise primitives XLA does not duplicate into a second consumer's fusion (its
``IsExpensive``): transcendental functions and division."""
TRAFFIC_PER_WRITE = 2
"""Memory passes per value written: the write and one read back."""


def fusible(eqn: Any) -> bool:
    """Whether XLA fuses ``eqn`` into one loop with the producers of its operands."""
    return eqn.primitive.name in FUSIBLE_PRIMITIVES or elementwise_call(eqn)


def regenerated(eqn: Any) -> bool:
    """Whether XLA recomputes ``eqn``'s output wherever it is read instead of storing it: an
    ``iota``, or a scalar broadcast to a shape (a mask's fill value, a zero gradient)."""
    name = eqn.primitive.name
    return name == "iota" or (name == "broadcast_in_dim" and not getattr(eqn.invars[0].aval, "shape", ()))


def split_residuals(
    forward: Sequence[Any], backward: Sequence[Any]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(stored, recomputed)``: of the values ``forward``'s ops make that ``backward``'s need,
    those that stay in memory between the two when both run in one program (a task that joins
    a microbatch's forward and backward), and those XLA computes again where they are read
    (:class:`~autopar._src.program.Op` or graph ops, anything with ``eqn``, ``ins`` and
    ``outs``).

    A value XLA can recompute where it is read is not stored: a :func:`regenerated` one, or a
    cheap one (:func:`fusible`, not a reduction nor among :data:`EXPENSIVE_PRIMITIVES`) whose
    readers in ``backward`` all fuse. The values it is recomputed from are then needed in its
    place, and stored or recomputed by the same rule.
    """
    made = {k: op for op in forward for k in op.outs if k is not None}

    def named(op: Any) -> list[Any]:
        return [k for k in op.ins if k is not None and not compat.is_literal(k) and k in made]

    readers: dict[Any, list[Any]] = {}
    for op in backward:
        for k in named(op):
            readers.setdefault(k, []).append(op)

    def fuses(op: Any) -> bool:
        return op.eqn is not None and fusible(op.eqn)

    def cheap(op: Any) -> bool:
        name = op.eqn.primitive.name if op.eqn is not None else ""
        return (
            fuses(op)
            and name not in EXPENSIVE_PRIMITIVES
            and name not in REDUCTION_PRIMITIVES
            and not elementwise_call(op.eqn)
        )

    stored: dict[Any, None] = {}
    recomputed: dict[Any, None] = {}
    seen: set[Any] = set()
    todo = list(readers)
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        op = made[key]
        if op.eqn is not None and (
            regenerated(op.eqn) or (cheap(op) and all(fuses(r) for r in readers.get(key, ())))
        ):
            recomputed[key] = None
            todo.extend(named(op))
        else:
            stored[key] = None
    return tuple(stored), tuple(recomputed)


def written_outputs(ops: Sequence[GraphOp]) -> list[tuple[bool, ...]]:
    """Per op, per output: whether the value is written to memory and charged as traffic.

    A heavy op's outputs are not charged (its FLOPs price it), nor are :func:`regenerated`
    ones. Another op's output is written when an op that is not :func:`fusible` reads it,
    when an op of another task reads it, or when no op of ``ops`` does (it leaves them).
    """
    readers: dict[Any, list[GraphOp]] = {}
    for op in ops:
        for name in op.ins:
            if name is not None:
                readers.setdefault(name, []).append(op)

    def written(name: Any, op: GraphOp) -> bool:
        rs = readers.get(name)
        return not rs or any(r.task != op.task or not fusible(r.eqn) for r in rs)

    return [
        tuple(False for _ in op.outs)
        if cost.eqn_flops(op.eqn) or regenerated(op.eqn)
        else tuple(name is not None and written(name, op) for name in op.outs)
        for op in ops
    ]


def op_traffic(ops: Sequence[GraphOp]) -> list[float]:
    """Bytes of memory traffic each op causes per step (its weight included), its values whole."""
    return [
        TRAFFIC_PER_WRITE
        * op.weight
        * float(sum(cost.aval_bytes(v.aval) for v, w in zip(op.eqn.outvars, flags, strict=True) if w))
        for op, flags in zip(ops, written_outputs(ops), strict=True)
    ]


LAYOUT_PRIMITIVES: frozenset[str] = frozenset("reshape squeeze expand_dims".split())
"""Equations that only relabel their operand's dims: on a value already in memory, a bitcast."""


def op_kernels(ops: Sequence[GraphOp]) -> list[float]:
    """Kernels each op launches per step (its weight included), as XLA's fusion leaves them.

    A heavy op is a kernel of its own, and so is an op that cannot fuse (a gather, a scatter,
    a sort); a chain of :func:`fusible` ops is one loop, counted at the op whose output it
    writes (:func:`written_outputs`), unless the chain only relabels a value already in
    memory (:data:`LAYOUT_PRIMITIVES` after a matmul, say: a bitcast). A :func:`regenerated`
    value costs none.
    """
    flags = written_outputs(ops)
    # Values a fused loop computes and keeps in registers for its readers in the same loop.
    working: set[Any] = set()
    kernels = []
    for op, written in zip(ops, flags, strict=True):
        eqn = op.eqn
        if regenerated(eqn):
            kernels.append(0.0)
            continue
        alone = bool(cost.eqn_flops(eqn)) or not fusible(eqn)
        works = not alone and (
            eqn.primitive.name not in LAYOUT_PRIMITIVES or any(k in working for k in op.ins if k is not None)
        )
        if works:
            working.update(k for k, w in zip(op.outs, written, strict=True) if k is not None and not w)
        kernels.append(op.weight * float(alone or (works and any(written))))
    return kernels
