"""Which outputs of a jaxpr (or of one equation) depend on which inputs, through nested calls,
rematerialised blocks, ``scan`` loops and ``cond`` branches, output by output.

``None`` stands for "not known" (a ``while`` loop, a body with constants): callers then treat
every output as possibly dependent. An equation whose body combines elements (a scatter's
``update_jaxpr``, a generic ``reduce``'s) makes each output from every operand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar._src import compat


def depends(jaxpr: Any, flags: Sequence[bool]) -> list[bool] | None:
    """For each output of the open ``jaxpr``, whether it depends on an input flagged in
    ``flags`` (one per input)."""
    reached = {v for v, f in zip(jaxpr.invars, flags, strict=True) if f}
    for e in jaxpr.eqns:
        out = eqn_depends(e, [not compat.is_literal(a) and a in reached for a in e.invars])
        if out is None:
            return None
        reached.update(v for v, f in zip(e.outvars, out, strict=True) if f)
    return [not compat.is_literal(v) and v in reached for v in jaxpr.outvars]


def eqn_depends(eqn: Any, flags: Sequence[bool]) -> list[bool] | None:
    """:func:`depends` for one equation: for each of its outputs, whether it depends on an
    operand flagged in ``flags``."""
    n = len(eqn.outvars)
    if not any(flags):
        return [False] * n
    if not compat.bodies(eqn):
        return [True] * n
    loop = compat.scan_loop(eqn)
    if loop is not None:  # carries feed the next iteration: grow the flags to a fixed point
        flags = list(flags)
        while True:
            out = depends(loop.body, flags)
            if out is None:
                return None
            grown = [k for k in range(loop.num_carry) if out[k] and not flags[loop.num_consts + k]]
            if not grown:
                return out
            for k in grown:
                flags[loop.num_consts + k] = True
    branches = compat.cond_branches(eqn)
    if branches is not None:
        if flags[0] or any(consts for _, consts in branches):  # the branch taken depends on it
            return None if not flags[0] else [True] * n
        outs = [depends(body, flags[1:]) for body, _ in branches]
        known = [o for o in outs if o is not None]
        if len(known) < len(outs):
            return None
        return [any(o[k] for o in known) for k in range(n)]
    if _combines(eqn):  # a scatter's update_jaxpr, a reduce's: not a body over the operands
        return [True] * n
    body = compat.operand_body(eqn)  # a nested jit, a remat, a custom_jvp/vjp primal
    return None if body is None else depends(body, flags)


_COMBINING = frozenset({"reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add"})


def _combines(eqn: Any) -> bool:
    """Whether ``eqn``'s body combines its operands' elements (a scatter's, a generic reduce's):
    each of its outputs reads all of its operands."""
    name = eqn.primitive.name
    return name.startswith("scatter") or name in _COMBINING
