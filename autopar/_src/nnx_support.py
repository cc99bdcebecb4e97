"""Differentiating Flax NNX modules with ``autopar.value_and_grad``.

As ``nnx.value_and_grad`` does, a module argument is split into its ``nnx.Param``
state (differentiated) and the rest (BatchNorm statistics, RNG counters, ...),
merged back inside the loss, and the rest's updates are written back into the
module after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx


def _is_graph(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def call_value_and_grad(
    inner: Callable[..., Any],
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    args: tuple[Any, ...],
) -> Any:
    """Calls ``inner(fun, argnums, has_aux, args)``, adapting NNX module arguments."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    nums = tuple(a % len(args) for a in nums)
    graph = [a for a in nums if _is_graph(args[a])]
    if not graph:
        return inner(fun, argnums, has_aux, args)
    splits = {a: nnx.split(args[a], nnx.Param, ...) for a in graph}
    pure_args = list(args)
    for a, (_, params, _) in splits.items():
        pure_args[a] = params

    def pure(*xs: Any) -> Any:
        full = list(xs)
        for a, (graphdef, _, rest) in splits.items():
            full[a] = nnx.merge(graphdef, xs[a], rest, copy=True)
        out = fun(*full)
        value, aux = out if has_aux else (out, None)
        updates = {a: nnx.state(full[a], nnx.Not(nnx.Param)) for a in graph}
        return value, (aux, updates)

    (value, (aux, updates)), grads = inner(pure, argnums, True, tuple(pure_args))
    for a, state in updates.items():
        nnx.update(args[a], state)
    return ((value, aux), grads) if has_aux else (value, grads)
