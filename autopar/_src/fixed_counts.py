"""Sums over the examples of drawn values that every draw makes the same, checked by making them.

A loss that divides by a sum over the examples of what it draws divides, per microbatch, by the
microbatch's own sum: the whole batch's loss only where that sum is the microbatch's share of
the whole batch's whatever the draw. MAE's count of masked patches is one: each example masks
the same number of its patches, at places a random permutation picks (``ids = argsort(noise)``,
``mask = argsort(ids) >= keep``), so ``mask.sum()`` is the batch size times that number.
:func:`is_fixed_share` makes such a sum from keys alone, at one microbatch and at the whole
batch, for a few keys: the same figure every time, the whole batch's ``num_microbatches`` times
the microbatch's. A sum read from anything but keys (the model's values, the batch) is not made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autopar._src import compat, layers

_TRIES = 3
_ELEMENTS = 1 << 22
"""Sums whose equations make more elements than this at the whole batch are not made."""


def is_fixed_share(eqns: Sequence[Any], twin: Mapping[int, Any], total: Any, nmb: int) -> bool:
    """Whether ``total`` (a value of ``eqns``, the loss function's equations at one of ``nmb``
    microbatches; ``twin``: ``id(eqn)`` -> its equation at the whole batch) is made from keys
    alone and is, for every key tried, one figure at one microbatch and ``nmb`` times it at the
    whole batch (see the module's docstring)."""
    made = {v: e for e in eqns for v in e.outvars if not compat.is_dropvar(v)}
    chain: list[Any] = []
    inputs: set[Any] = set()  # the keys the chain reads
    needed, seen = [total], set()
    while needed:
        a = needed.pop()
        if compat.is_literal(a) or a in seen:
            continue
        seen.add(a)
        e = made.get(a)
        if e is None:
            return False  # an input other than a key, reached below
        if layers.is_boundary(e) or id(e) not in twin or getattr(e, "effects", None):
            return False
        if e not in chain:
            chain.append(e)
        for b in e.invars:
            if compat.is_literal(b):
                continue
            if b in made:
                needed.append(b)
            elif _is_key(b):
                inputs.add(b)
            else:
                return False
    if not inputs:
        return False
    order = {id(e): k for k, e in enumerate(eqns)}
    chain.sort(key=lambda e: order[id(e)])
    if sum(math.prod(v.aval.shape) for e in chain for v in twin[id(e)].outvars) > _ELEMENTS:
        return False
    figures = []
    for trial in range(_TRIES):
        keys = {a: _key(a, trial) for a in inputs}
        if any(k is None for k in keys.values()):
            return False
        try:
            mine, theirs = _run(chain, keys, total, None), _run(chain, keys, total, twin)
        except Exception:  # noqa: BLE001 - what cannot be made from made-up keys: not checked
            return False
        figures.append((mine, theirs))
    first, whole = figures[0]
    same = all(np.array_equal(m, first) and np.array_equal(w, whole) for m, w in figures)
    return same and bool(np.allclose(whole, nmb * first, rtol=1e-6))


def _run(
    chain: Sequence[Any], keys: Mapping[Any, Any], total: Any, twin: Mapping[int, Any] | None
) -> np.ndarray:
    """``total`` made by the equations of ``chain`` from ``keys``, or by their twins at the whole
    batch (``twin``), whose operands are read by position."""
    values: dict[Any, Any] = dict(keys)
    for e in chain:
        q = e if twin is None else twin[id(e)]
        ins = [
            compat.literal_value(b) if compat.is_literal(b) else values[a]
            for a, b in zip(e.invars, q.invars, strict=True)
        ]
        values.update(zip(e.outvars, compat.bind_eqn(q, ins), strict=True))
    return np.asarray(values[total])


def _is_key(a: Any) -> bool:
    dtype = a.aval.dtype
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _key(a: Any, trial: int) -> Any:
    """Made-up keys of ``a``'s shape, or None for a kind of key not made here."""
    keys = jax.random.split(jax.random.key(1 + trial), max(1, math.prod(a.aval.shape)))
    return keys.reshape(a.aval.shape) if keys.dtype == a.aval.dtype else None
