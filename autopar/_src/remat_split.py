"""A loss rematerialised as one call, cut into layers all the same.

A step that wraps its whole loss, or most of it, in one ``jax.checkpoint`` (``nn.remat`` of the
whole model) leaves the loss one heavy equation: nothing to cut between. Such a call (one that
holds at least :data:`SPLIT_SHARE` of the loss's FLOPs) is split into *segments*, one call per
heavy equation of its body (nested ``jit``\\ s inlined), each rematerialised with the call's
policy. The layers are cut between segments, and :func:`merged` joins a layer's consecutive
segments of one call back into one ``jax.checkpoint``: each stage recomputes its share of the
call from its own inputs, as the whole call recomputed the whole loss, and with one stage the
call is what the user wrote.

The segments carry the call's policy wrapped in :class:`Segment`, which decides what to save as
the policy does and names the call the segment came from.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar._src import compat, cost

SPLIT_SHARE = 0.5
"""A rematerialised call holding at least this share of the loss's FLOPs is split."""

_ORIGINS = itertools.count()

Run = Callable[[Any, Sequence[Any], Sequence[Any]], list[Any]]
"""Evaluates an open jaxpr on constants and arguments, nested calls inlined."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """The policy of a segment of rematerialised call ``origin``: ``policy``'s decisions (save
    nothing where it is None, as ``jax.checkpoint``'s default)."""

    policy: Any
    origin: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return False if self.policy is None else self.policy(*args, **kwargs)


def should_split(eqn: Any, threshold: float | None) -> bool:
    """Whether ``eqn`` is a rematerialised call with at least ``threshold`` FLOPs."""
    return threshold is not None and compat.remat_body(eqn) is not None and cost.eqn_flops(eqn) >= threshold


def split(eqn: Any, invals: Sequence[Any], run: Run) -> list[Any]:
    """Binds the rematerialised call ``eqn`` on ``invals`` as consecutive segments, one per heavy
    equation of its body (use under tracing)."""
    body = compat.remat_body(eqn)
    flat = jax.make_jaxpr(lambda *xs: run(body, [], xs))(*invals)
    jaxpr, consts = compat.jaxpr_and_consts(flat)
    heavy = [i for i, e in enumerate(jaxpr.eqns) if cost.eqn_flops(e) > 0]
    ends = [i + 1 for i in heavy[:-1]] + [len(jaxpr.eqns)] if heavy else [len(jaxpr.eqns)]
    policy = Segment(eqn.params["policy"], next(_ORIGINS))
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *invals], strict=True))
    later = compat.last_reads(jaxpr)
    start = 0
    for end in ends:
        group = jaxpr.eqns[start:end]
        ins = _inputs(group)
        outs = [v for v in _defined(group) if later.get(v, -1) >= end]
        fn = _group_fn(group, ins, outs, compat.bind_eqn)
        results = jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"], policy=policy)(
            *[env[v] for v in ins]
        )
        env.update(zip(outs, results, strict=True))
        start = end
    return [compat.literal_value(a) if compat.is_literal(a) else env[a] for a in jaxpr.outvars]


def merge_run(eqns: Sequence[Any], start: int, cuts: Sequence[int]) -> int:
    """The end of the run of segments of one call that starts at ``eqns[start]``, within its
    layer (before the next of ``cuts``); ``start`` itself if ``eqns[start]`` is no segment."""
    policy = _segment_policy(eqns[start])
    if policy is None:
        return start
    stop = min([c for c in cuts if c > start], default=len(eqns))
    end = start + 1
    while end < stop and getattr(_segment_policy(eqns[end]), "origin", None) == policy.origin:
        end += 1
    return end


def merged(jaxpr: Any, start: int, end: int, env: dict[Any, Any], later: dict[Any, int], run: Run) -> None:
    """Binds the segments ``jaxpr.eqns[start:end]`` (of one call) as one ``jax.checkpoint`` with
    the call's own policy, reading and writing values in ``env`` (``later``: each value's last
    reader, :func:`compat.last_reads`; use under tracing)."""
    group = jaxpr.eqns[start:end]
    ins = _inputs(group)
    outs = [v for v in _defined(group) if later.get(v, -1) >= end]
    policy = _segment_policy(group[0])
    assert policy is not None, "a merged run starts with a segment"

    def bind(e: Any, vals: list[Any]) -> list[Any]:
        return run(compat.remat_body(e), [], vals)

    results = jax.checkpoint(
        _group_fn(group, ins, outs, bind), prevent_cse=group[0].params["prevent_cse"], policy=policy.policy
    )(*[_read(a, env) for a in ins])
    env.update(zip(outs, results, strict=True))


def _segment_policy(eqn: Any) -> Segment | None:
    if compat.remat_body(eqn) is None:
        return None
    policy = eqn.params["policy"]
    return policy if isinstance(policy, Segment) else None


def _group_fn(
    group: Sequence[Any], ins: Sequence[Any], outs: Sequence[Any], bind: Callable[[Any, list[Any]], list[Any]]
) -> Callable[..., list[Any]]:
    """The function of ``ins`` to ``outs`` that binds ``group``'s equations with ``bind``."""

    def fn(*xs: Any) -> list[Any]:
        local = dict(zip(ins, xs, strict=True))
        for e in group:
            vals = bind(e, [_read(a, local) for a in e.invars])
            local.update((v, x) for v, x in zip(e.outvars, vals, strict=True) if not compat.is_dropvar(v))
        return [local[v] for v in outs]

    return fn


def _read(a: Any, env: dict[Any, Any]) -> Any:
    return compat.literal_value(a) if compat.is_literal(a) else env[a]


def _defined(group: Sequence[Any]) -> list[Any]:
    return [v for e in group for v in e.outvars if not compat.is_dropvar(v)]


def _inputs(group: Sequence[Any]) -> list[Any]:
    """The variables ``group`` reads that it does not define, in first-read order."""
    made = set(_defined(group))
    seen: dict[Any, None] = {}
    for e in group:
        for a in e.invars:
            if not compat.is_literal(a) and a not in made:
                seen.setdefault(a, None)
    return list(seen)
