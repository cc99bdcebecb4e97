"""Loops over the examples run once per microbatch, checked by running them.

With microbatches, a loop whose trip count follows the batch (a ``scan`` or ``fori_loop`` over
the rows or chunks of them, a ``while_loop`` up to the batch size) runs once per microbatch, over
its rows, from its initial carries. That gives ``jax.jit``'s result where each iteration's work
depends on its own rows alone and what the loop carries to its end adds up (a sum, a running
mean, a max or min) over the microbatches. :func:`restart_differs` runs the loop on made-up
operands both ways, at the whole batch and once per microbatch's rows, and compares: a key split
per row, the counter read as a position, an exponential moving average carried to the end, a
recurrence hidden in a ``while`` loop or behind nested ``jit``s, a running logsumexp all differ.
:mod:`~autopar._src.loop_carries` finds the common cases by the loop's form first.

Operands made from no input (an iota of the rows' numbers, a literal) take their values in each
trace; the rest are drawn at random, the examples' rows (one dim per example) split between the
microbatches. A loop that cannot be run so (no such dim, a key of a kind not drawn here, effects,
operands too large to make up, a failure) is left to the form checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopar._src import batch_scaling, compat, twin_traces

Values = Callable[[Any], Any]
"""A variable's value where it is made from no input, else None."""

_RTOL = 1e-4
_ELEMENTS = 1 << 22
"""Loops whose operands at the whole batch hold more elements than this are not run (a chunked
loss over a large vocabulary): they are left to the form checks."""


def restart_differs(
    e: Any,
    other: Any,
    nmb: int,
    live: Set[Any] | None = None,
    values: tuple[Values, Values] | None = None,
) -> bool:
    """Whether the loop ``e`` (``other``: its twin at the whole batch) run once per microbatch
    gives other results than at the whole batch: a result with a dim per example that is not the
    microbatches' concatenated, or one without that is neither unchanged nor their sum, mean,
    max or min. ``live``: the results that count (None: all). ``values``: the static values of
    ``e``'s and ``other``'s operands (see the module's docstring)."""
    if getattr(e, "effects", None):
        return False
    if sum(math.prod(twin_traces.shape_of(b)) for b in other.invars) > _ELEMENTS:
        return False
    operands = _operands(e, other, nmb, values)
    if operands is None:
        return False
    whole, parts = operands
    try:
        got = [compat.bind_eqn(other, whole)] + [compat.bind_eqn(e, p) for p in parts]
    except Exception:  # noqa: BLE001 - a body that cannot run on made-up values: not checked
        return False
    for j, (v, w) in enumerate(zip(e.outvars, other.outvars, strict=True)):
        if compat.is_dropvar(v) or (live is not None and v not in live):
            continue
        dims = twin_traces.per_example_dims(v, w, nmb)
        if len(dims) > 1:
            continue
        at_whole, per_part = _numbers(got[0][j]), [_numbers(g[j]) for g in got[1:]]
        if dims:
            (d,) = dims
            candidates = [np.concatenate(per_part, axis=d)]
        else:
            stacked = np.stack(per_part)
            candidates = [per_part[0], stacked.sum(0), stacked.mean(0), stacked.max(0), stacked.min(0)]
        if not any(_close(c, at_whole) for c in candidates):
            return True
    return False


def _operands(
    e: Any, other: Any, nmb: int, values: tuple[Values, Values] | None
) -> tuple[list[Any], list[list[Any]]] | None:
    """The whole batch's operands and each microbatch's, or None where some cannot be made."""
    rng = np.random.default_rng(0)
    whole: list[Any] = []
    parts: list[list[Any]] = [[] for _ in range(nmb)]
    split = False
    for a, b in zip(e.invars, other.invars, strict=True):
        if compat.is_literal(a) or compat.is_literal(b):
            if not (compat.is_literal(a) and compat.is_literal(b)):
                return None
            whole.append(compat.literal_value(b))
            for p in parts:
                p.append(compat.literal_value(a))
            continue
        mine, theirs = (values[0](a), values[1](b)) if values is not None else (None, None)
        if mine is not None and theirs is not None:
            whole.append(theirs)
            for p in parts:
                p.append(mine)
            continue
        dims = twin_traces.per_example_dims(a, b, nmb)
        drawn = _draw(b.aval, rng)
        if drawn is None or len(dims) > 1 or (not dims and a.aval.shape != b.aval.shape):
            return None
        whole.append(drawn)
        if not dims:
            for p in parts:
                p.append(drawn)
            continue
        (d,) = dims
        rows = twin_traces.shape_of(a)[d]
        split = True
        for k, p in enumerate(parts):
            p.append(jax.lax.slice_in_dim(drawn, k * rows, (k + 1) * rows, axis=d))
    return (whole, parts) if split else None


def _draw(aval: Any, rng: np.random.Generator) -> Any:
    """Made-up values of ``aval``'s shape and type, or None for a type not drawn here."""
    shape, dtype = tuple(aval.shape), aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), int(np.prod(shape)))
        return keys.reshape(shape) if keys.dtype == dtype else None
    if jax.dtypes.issubdtype(dtype, np.bool_):
        return jnp.asarray(rng.random(shape) < 0.5)
    if jax.dtypes.issubdtype(dtype, np.integer):
        return jnp.asarray(rng.integers(0, 3, shape), dtype)
    if jax.dtypes.issubdtype(dtype, np.floating) or jax.dtypes.issubdtype(dtype, np.complexfloating):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return None


def _numbers(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    finite = np.abs(b[np.isfinite(b)])
    scale = float(finite.max()) if finite.size else 1.0
    return bool(np.allclose(a, b, rtol=_RTOL, atol=_RTOL * max(1.0, scale), equal_nan=True))


def counts_batch(e: Any, other: Any, nmb: int) -> bool:
    """Whether ``e`` (``other``: its twin at the whole batch) is a ``while`` loop whose predicate
    compares with a size that follows the batch (``i < x.shape[0]``)."""
    if compat.while_body(e) is None or compat.while_body(other) is None:
        return False
    return batch_scaling.batch_literals(e.params["cond_jaxpr"], other.params["cond_jaxpr"], nmb)
