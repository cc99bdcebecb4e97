"""Static arguments (``static_argnums``), as ``jax.jit`` has them: Python values (a mode string,
a flag, a module) that the step branches on while it is traced. Each distinct set of their values
gets its own step, a function of the other arguments with those values bound, planned and
compiled once; the values must be hashable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def positions(static_argnums: Sequence[int], num_args: int) -> tuple[int, ...]:
    """``static_argnums`` as positions among ``num_args`` arguments, in order.

    Raises:
      ValueError: for a position out of range.
    """
    for a in static_argnums:
        if not -num_args <= a < num_args:
            raise ValueError(
                f"static_argnums={tuple(static_argnums)} names argument {a}, but the step got "
                f"{num_args} positional arguments"
            )
    return tuple(sorted({a % num_args for a in static_argnums}))


def key(args: Sequence[Any], static: tuple[int, ...]) -> tuple[Any, ...]:
    """The static arguments' values, as a cache key.

    Raises:
      ValueError: for a value that cannot be hashed.
    """
    values = tuple(args[i] for i in static)
    for i, v in zip(static, values, strict=True):
        try:
            hash(v)
        except TypeError as e:
            raise ValueError(
                f"static argument {i} ({type(v).__name__}) is not hashable, so its steps cannot be "
                "told apart; pass a hashable value (a tuple rather than a list), or take it out of "
                "static_argnums if it holds arrays"
            ) from e
    return (static, values)


def bound(fn: Callable[..., Any], args: Sequence[Any], static: tuple[int, ...]) -> Callable[..., Any]:
    """``fn`` as a function of its other arguments, the static ones bound to their values in
    ``args``."""
    values = {i: args[i] for i in static}
    total = len(args)

    def step(*others: Any) -> Any:
        rest = iter(others)
        return fn(*(values[i] if i in values else next(rest) for i in range(total)))

    step.__name__ = getattr(fn, "__name__", "step")
    return step


def others(args: Sequence[Any], static: tuple[int, ...]) -> tuple[Any, ...]:
    """The arguments that are not static, in order."""
    return tuple(x for i, x in enumerate(args) if i not in static)


def moved(argnums: tuple[int, ...], static: tuple[int, ...], num_args: int, what: str) -> tuple[int, ...]:
    """``argnums`` (of all ``num_args`` arguments) as positions among the others; ``what`` names
    the option in errors.

    Raises:
      ValueError: for an argument both static and in ``argnums``.
    """
    result = []
    for a in argnums:
        p = a % num_args if -num_args <= a < num_args else a
        if p in static:
            raise ValueError(
                f"{what}={argnums} and static_argnums name the same argument {a}; a static argument "
                "is a Python value the step is traced with, not arrays to split or donate"
            )
        result.append(p - sum(1 for s in static if s < p) if 0 <= p < num_args else p)
    return tuple(result)
