"""Which values are sums over the examples of terms per example, every term of them
(:attr:`~autopar._src.batch_scaling.Scaling.sum`): the microbatches' values add up to the whole
batch's. Made by a ``reduce_sum`` over the examples (in :mod:`~autopar._src.batch_scaling`),
kept by linear maps whose coefficients no example makes, and made by loops: a carry that starts
at zero and adds such terms each iteration."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autopar._src import carry_updates, compat

_LINEAR = frozenset(
    {
        "convert_element_type", "copy", "copy_p", "neg", "reduce_precision", "reduce_sum",
        "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
    }
)  # fmt: skip
"""Maps of one operand that keep a sum over the examples one."""


def linear(e: Any, sums: Sequence[bool], free: Sequence[bool]) -> bool:
    """Whether ``e`` (reducing over no examples) makes a sum over the examples from its operands,
    of which ``sums`` are ones and ``free`` are made from no example and scaled by nothing of the
    batch: a linear map of sums with free coefficients (``0.5 * losses.sum() / C``). A term
    added that is no sum (a regulariser, a mean) would count once per microbatch: not one."""
    name = e.primitive.name
    if name in _LINEAR:
        return len(sums) == 1 and sums[0]
    if name in ("add", "sub", "add_any"):
        return all(sums)
    if name in ("mul", "dot_general"):
        return (sums[0] and free[1]) or (sums[1] and free[0])
    if name == "div":
        return sums[0] and free[1]
    return False


def running_sums(
    loop: compat.Loop, operands: Sequence[Any], candidates: Sequence[bool], term: Callable[[Any], bool]
) -> set[int]:
    """The carries of ``loop`` (among ``candidates``, by position; ``operands``: the atoms it
    starts from, constants first) that start at a literal zero and add, each iteration, only
    terms of its body that ``term`` accepts (in a loop over the examples, values per example; in
    any other loop, sums over the examples)."""
    links = carry_updates.Links(loop.body.eqns)
    found = set()
    for k, v in enumerate(loop.body.outvars[: loop.num_carry]):
        if not candidates[k] or not _zero(operands[loop.num_consts + k]):
            continue
        kind, terms, _ = carry_updates.update(v, loop.body.invars[loop.num_consts + k], links)
        if kind == "sum" and all(term(t) for t in terms):
            found.add(k)
    return found


def _zero(atom: Any) -> bool:
    """Whether ``atom`` is a literal zero (a running sum's start: ``lax.scan(f, 0.0, xs)``)."""
    if not compat.is_literal(atom):
        return False
    try:
        return float(compat.literal_value(atom)) == 0.0
    except (TypeError, ValueError):  # arrays, keys
        return False
