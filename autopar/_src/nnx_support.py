"""Differentiating Flax NNX modules with ``autopar.value_and_grad``.

As ``nnx.value_and_grad`` does, a module argument is split into its ``nnx.Param``
state (differentiated) and the rest (BatchNorm statistics, RNG counters, ...),
merged back inside the loss, and the rest's updates are written back into the
module after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx


def _is_graph(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def _is_nnx(x: Any) -> bool:
    return isinstance(x, nnx.Module | nnx.Pytree)


def call_value_and_grad(
    inner: Callable[..., Any],
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    args: tuple[Any, ...],
) -> Any:
    """Calls ``inner(fun, argnums, has_aux, args)``, adapting NNX module arguments.

    Raises:
      ValueError: if ``argnums`` is not an int or a sequence of ints (e.g. ``nnx.DiffState``).
    """
    ints = isinstance(argnums, int) or (
        isinstance(argnums, Sequence) and all(isinstance(a, int) for a in argnums)
    )
    if not ints:
        raise ValueError(
            f"argnums must be an int or a sequence of ints, got {argnums!r}. To differentiate part of a "
            "module's state (nnx.DiffState), split it out with nnx.split(model, nnx.LoRAParam, ...), "
            "differentiate that state and nnx.merge it inside the loss function."
        )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    nums = tuple(a % len(args) for a in nums)
    graph = [a for a in nums if _is_graph(args[a])]
    # NNX objects passed but not differentiated (e.g. an nnx.Rngs the loss draws from): their
    # whole state goes in as an argument and its updates come back, as nnx.value_and_grad does.
    others = [a for a, x in enumerate(args) if a not in nums and _is_nnx(x)]
    if not graph and not others:
        return inner(fun, argnums, has_aux, args)
    # One split of all of them, so objects they share stay shared.
    positions = sorted([*graph, *others])
    index = {a: k for k, a in enumerate(positions)}
    diff_at = {index[a] for a in graph}

    def differentiated(path: tuple[Any, ...], x: Any) -> bool:
        return isinstance(x, nnx.Param) and path[0] in diff_at

    objs = tuple(args[a] for a in positions)
    graphdef, *states = nnx.split(objs, differentiated, ...)
    params, rest = states
    for a in graph:
        own = len(jax.tree.leaves(nnx.state(args[a], nnx.Param)))
        if own != len(jax.tree.leaves(params.get(index[a], {}))):
            raise ValueError(
                f"Argument {a} is differentiated, but some of its nnx.Param state is also reached from "
                "an earlier argument of the loss function (shared); nnx.value_and_grad refuses such "
                "aliasing too. Pass the shared module once."
            )
    pure_args = list(args)
    for a in others:
        pure_args[a] = None  # in ``rest``
    for a in graph:
        pure_args[a] = params[index[a]]

    def pure(*xs: Any) -> Any:
        merged = nnx.merge(graphdef, nnx.State({index[a]: xs[a] for a in graph}), rest, copy=True)
        full = list(xs)
        for a, obj in zip(positions, merged, strict=True):
            full[a] = obj
        out = fun(*full)
        value, aux = out if has_aux else (out, None)
        return value, (aux, nnx.state(merged, nnx.Not(differentiated)))

    (value, (aux, updates)), grads = inner(pure, argnums, True, tuple(pure_args))
    nnx.update(objs, updates)
    return ((value, aux), grads) if has_aux else (value, grads)


def object_positions(args: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the step's arguments that are NNX objects (a model, an ``nnx.Optimizer``)."""
    return tuple(i for i, x in enumerate(args) if _is_nnx(x))


def require_no_nested_objects(args: tuple[Any, ...]) -> None:
    """Raises if an NNX object sits inside an argument (``step({"model": model}, batch)``):
    flattened as a pytree, its updates in place would be lost.

    Raises:
      ValueError: naming the object's path.
    """
    for path, x in jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_nnx)[0]:
        if _is_nnx(x):
            raise ValueError(
                f"The step's arguments hold an NNX object ({type(x).__name__}) at "
                f"{jax.tree_util.keystr(path)}, inside another argument, where its updates in place "
                "would be lost. Pass each NNX object as an argument of its own (step(model, "
                "optimizer, batch)), or pass nnx.state(...) and return the new state."
            )


def functional_step(fn: Callable[..., Any], positions: tuple[int, ...], graphdef: Any) -> Callable[..., Any]:
    """``fn``, which updates its NNX object arguments (at ``positions``) in place, as
    ``nnx.jit`` runs it: a pure function of the objects' joint state (argument 0) and the other
    arguments, returning ``(the objects' new state, fn's outputs)``: the new state at the
    input's pytree paths, so that the sharding search keeps each leaf where the next step
    reads it (``intra_op.carried_state``)."""

    def pure(state: Any, *others: Any) -> Any:
        objs = nnx.merge(graphdef, state)
        out = fn(*interleaved(objs, others, positions))
        return nnx.state(objs), out

    pure.__name__ = getattr(fn, "__name__", "step")
    return pure


def moved_argnums(argnums: tuple[int, ...], positions: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``argnums`` of the step as positions of :func:`functional_step`'s arguments (the objects'
    state first, then the others in order); ``what`` names the option in errors.

    Raises:
      ValueError: for a batch argument that is an NNX object.
    """
    moved = []
    for a in argnums:
        if a in positions:
            if what == "batch_argnums":
                raise ValueError(
                    f"batch_argnums={argnums!r} names argument {a}, an NNX object; the batch is split "
                    "into microbatches along its leading dim, so it must be arrays. Name the "
                    "argument that holds the batch."
                )
            moved.append(0)
        else:
            moved.append(1 + a - sum(1 for p in positions if p < a))
    return tuple(dict.fromkeys(moved))


def interleaved(objs: Any, others: Sequence[Any], positions: tuple[int, ...]) -> tuple[Any, ...]:
    """The step's arguments again: ``objs[k]`` (the objects, or their state's entries) at
    ``positions[k]``, ``others`` in order around them."""
    rest = iter(others)
    return tuple(
        objs[positions.index(i)] if i in positions else next(rest)
        for i in range(len(positions) + len(others))
    )
