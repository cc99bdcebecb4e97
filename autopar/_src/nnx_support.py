"""Differentiating Flax NNX modules with ``autopar.value_and_grad``.

As ``nnx.value_and_grad`` does, a module argument is split into its ``nnx.Param`` state, or
the state an ``nnx.DiffState`` names (``nnx.LoRAParam``), which is differentiated, and the rest
(BatchNorm statistics, RNG counters, frozen weights, ...), merged back inside the loss, and the
rest's updates are written back into the module after the call.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx


def _is_graph(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def _is_nnx(x: Any) -> bool:
    return isinstance(x, nnx.Module | nnx.Pytree)


def _argnums_and_filters(argnums: Any, nargs: int) -> tuple[int | tuple[int, ...], dict[int, Any]]:
    """``argnums`` as ``jax.value_and_grad`` takes them (``nnx.DiffState``s by their argnum), and
    the NNX filter of the state to differentiate at each position: a ``DiffState``'s, else None
    (``nnx.Param``).

    Raises:
      ValueError: if ``argnums`` holds anything but ints and ``nnx.DiffState``s, or one position
        twice.
    """
    single = isinstance(argnums, numbers.Integral | nnx.DiffState)
    items = (argnums,) if single else tuple(argnums) if isinstance(argnums, Sequence) else None
    if items is None or not all(
        isinstance(a.argnum if isinstance(a, nnx.DiffState) else a, numbers.Integral) for a in items
    ):
        raise ValueError(f"argnums must be an int, an nnx.DiffState or a sequence of them, got {argnums!r}.")
    nums = tuple(operator.index(a.argnum if isinstance(a, nnx.DiffState) else a) % nargs for a in items)
    if len(set(nums)) < len(nums):
        raise ValueError(f"argnums={argnums!r} names an argument more than once; name each once.")
    filters = {
        n: a.filter if isinstance(a, nnx.DiffState) else None for n, a in zip(nums, items, strict=True)
    }
    return (nums[0] if single else nums), filters


def call_value_and_grad(
    inner: Callable[..., Any],
    fun: Callable[..., Any],
    argnums: Any,
    has_aux: bool,
    args: tuple[Any, ...],
) -> Any:
    """Calls ``inner(fun, argnums, has_aux, args)``, adapting NNX module arguments: each is
    differentiated in its ``nnx.Param`` state, or in the state an ``nnx.DiffState`` among
    ``argnums`` names (``nnx.DiffState(0, nnx.LoRAParam)``), as ``nnx.value_and_grad`` does.

    Raises:
      ValueError: if ``argnums`` holds anything but ints and ``nnx.DiffState``s, or a
        ``DiffState`` names an argument that is no NNX module.
    """
    argnums, filters = _argnums_and_filters(argnums, len(args))
    for a, filt in filters.items():
        if filt is not None and not _is_graph(args[a]):
            raise ValueError(
                f"nnx.DiffState({a}, ...) names argument {a}, a {type(args[a]).__name__}, not an "
                "nnx.Module, whose state autopar would filter: pass the part to differentiate as an "
                "argument of its own."
            )
    nums = tuple(filters)
    graph = [a for a in nums if _is_graph(args[a])]
    # NNX objects passed but not differentiated (e.g. an nnx.Rngs the loss draws from): their
    # whole state goes in as an argument and its updates come back, as nnx.value_and_grad does.
    others = [a for a, x in enumerate(args) if a not in nums and _is_nnx(x)]
    if not graph and not others:
        return inner(fun, argnums, has_aux, args)
    # One split of all of them, so objects they share stay shared.
    positions = sorted([*graph, *others])
    index = {a: k for k, a in enumerate(positions)}
    filters = {a: nnx.Param if filt is None else filt for a, filt in filters.items()}
    wanted = {index[a]: nnx.filterlib.to_predicate(filters[a]) for a in graph}

    def differentiated(path: tuple[Any, ...], x: Any) -> bool:
        return path[0] in wanted and isinstance(x, nnx.Variable) and wanted[path[0]](path[1:], x)

    objs = tuple(args[a] for a in positions)
    graphdef, *states = nnx.split(objs, differentiated, ...)
    params, rest = states
    for a in graph:
        own = len(jax.tree.leaves(nnx.state(args[a], filters[a])))
        if own != len(jax.tree.leaves(params.get(index[a], {}))):
            raise ValueError(
                f"Argument {a} is differentiated, but some of its differentiated state is also "
                "reached from an earlier argument of the loss function (shared); nnx.value_and_grad "
                "refuses such aliasing too. Pass the shared module once."
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
