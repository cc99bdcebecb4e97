"""How the loss function's batch-free values scale with the batch, from its two traces (at one
microbatch and at the whole batch): whether averaging a value over microbatches gives the
whole batch's value.

A mean over the examples (a sum divided by the batch size, which differs between the traces
as a literal: ``div b 4.0`` against ``div b 16.0``) has degree 0 and averages exactly; so does
a ratio of two sums (a masked mean, exact when the microbatches hold equal weights). A sum over
the examples has degree 1: averaged, it would come back divided by the number of microbatches.
A value reduced over the examples by anything but a sum (a ``max``, one example picked out) is
*extreme*: no average of the microbatches' values gives it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopar._src import compat, layers

_SUMS = frozenset({"reduce_sum", "dot_general"})


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How a value scales with the batch size: as its ``degree``-th power, or not at all
    (``extreme``)."""

    degree: float
    origin: Any
    """The equation that reduced over the examples."""
    extreme: bool = False
    unknown: bool = False
    """Reduced over the examples inside a body (a loop, a ``custom_jvp``, a scatter's): not
    followed, so neither it nor what is made from it is checked."""


def scalings(eqns: Sequence[Any], twin: Mapping[int, Any], tainted: set[Any], nmb: int) -> dict[Any, Scaling]:
    """The values of ``eqns`` that are not batch-independent means: their :class:`Scaling`.

    Args:
      eqns: the loss function's equations at one microbatch.
      twin: ``id(eqn)`` -> the same equation at the whole batch (layer boundaries aside).
      tainted: the values computed from the examples.
      nmb: the number of microbatches (the ratio of the traces' batch sizes).
    """
    found: dict[Any, Scaling] = {}
    for e in eqns:
        if layers.is_boundary(e):  # an identity per value
            for a, v in zip(e.invars, e.outvars, strict=True):
                if not compat.is_literal(a) and a in found:
                    found[v] = found[a]
            continue
        other = twin[id(e)]
        ins = [None if compat.is_literal(a) else found.get(a) for a in e.invars]
        unknown = next((s for s in ins if s is not None and s.unknown), None)
        extreme = next((s for s in ins if s is not None and s.extreme), None)
        if not any(is_float(v) or _is_int(v) for v in e.outvars):
            scaling: Scaling | None = None  # predicates (a guard on any(mask)): no magnitude
        elif unknown is not None:
            scaling = unknown
        elif _reduces_batch(e, other, tainted):
            if e.primitive.name in _SUMS:
                degree = 1 + sum(s.degree for s in ins if s is not None)
                scaling = extreme or (Scaling(degree, e) if degree else None)
            elif compat.bodies(e):  # a loop, custom_jvp or scatter reducing in its body
                scaling = Scaling(0.0, e, unknown=True)
            else:
                scaling = Scaling(0.0, e, extreme=True)
        elif extreme is not None:
            scaling = extreme
        else:
            degrees = [_literal_degree(a, b, nmb) for a, b in zip(e.invars, other.invars, strict=True)]
            degrees = [s.degree if s is not None else d for s, d in zip(ins, degrees, strict=True)]
            degree = _degree(e, degrees)
            origin = next((s.origin for s in ins if s is not None), e)
            scaling = Scaling(degree, origin) if degree else None
        if scaling is not None:
            found.update((v, scaling) for v in e.outvars if not compat.is_dropvar(v))
    return found


def _reduces_batch(e: Any, other: Any, tainted: set[Any]) -> bool:
    """Whether ``e`` reads a value with a dim per example and makes values without one."""
    grown = any(
        not compat.is_literal(a) and a in tainted and a.aval.shape != b.aval.shape
        for a, b in zip(e.invars, other.invars, strict=True)
    )
    same = all(v.aval.shape == w.aval.shape for v, w in zip(e.outvars, other.outvars, strict=True))
    return grown and same


def _literal_degree(a: Any, b: Any, nmb: int) -> float:
    """1 for a literal that is the batch size's multiple (``b`` is ``a`` times ``nmb``), -1 for
    its reciprocal's, 0 otherwise."""
    if not (compat.is_literal(a) and compat.is_literal(b)):
        return 0.0
    try:
        x, y = float(compat.literal_value(a)), float(compat.literal_value(b))
    except (TypeError, ValueError):  # arrays, keys
        return 0.0
    if x == 0 or x == y:
        return 0.0
    ratio = y / x
    # Loosely: a bfloat16 batch size is rounded.
    return (
        1.0
        if math.isclose(ratio, nmb, rel_tol=0.02)
        else -1.0
        if math.isclose(ratio, 1 / nmb, rel_tol=0.02)
        else 0.0
    )


def is_float(var: Any) -> bool:
    """Whether ``var`` holds floating-point (or complex) values."""
    return bool(jax.dtypes.issubdtype(var.aval.dtype, jnp.inexact))


def _is_int(var: Any) -> bool:
    return bool(jax.dtypes.issubdtype(var.aval.dtype, jnp.integer))


def _degree(e: Any, degrees: list[float]) -> float:
    """The degree of ``e``'s outputs from its operands' ``degrees``."""
    name = e.primitive.name
    if name == "mul" or name == "dot_general":
        return degrees[0] + degrees[1]
    if name == "div":
        return degrees[0] - degrees[1]
    if name == "integer_pow":
        return degrees[0] * e.params["y"]
    if name == "sqrt":
        return degrees[0] / 2
    if name == "rsqrt":
        return -degrees[0] / 2
    return max(degrees, key=abs, default=0.0)  # sums, casts, reshapes, ... keep what they read
