"""The step's own ``with_sharding_constraint`` calls, dropped while tracing.

autopar lays out every value itself: the sharding ILP chooses each stage's layouts on the
stage's own submesh. A constraint written for a hand-written plan names a mesh of its own,
which a stage on other devices cannot run (XLA refuses a computation over two device sets),
and a layout the ILP did not choose. So while ``@autoparallel`` traces a step,
:func:`autopar._src.layers.inline_calls` evaluates every such constraint as the identity,
inside nested calls, rematerialised calls, ``scan`` and ``while`` bodies and ``cond``
branches too, and warns once per line that wrote one. A constraint it cannot take out (in a
``custom_jvp``/``custom_vjp`` function or a ``while`` predicate) is an error naming its line.

An equation that runs on a mesh of its own (``shard_map``) cannot be dropped: a step with one
runs as one stage on exactly that mesh's devices (:func:`check_meshes`; ``num_stages="auto"``
searches only such plans).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from autopar._src import compat

Run = Callable[..., list[Any]]
"""``run(body, consts, *xs)``: a body evaluated on ``xs`` with its constraints dropped."""


def is_constraint(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``with_sharding_constraint``."""
    return eqn.primitive.name == "sharding_constraint"


def first_constraint(jaxpr: Any) -> Any | None:
    """The first ``with_sharding_constraint`` equation in ``jaxpr`` or its bodies, or None."""
    for eqn in jaxpr.eqns:
        if is_constraint(eqn):
            return eqn
        for body in compat.bodies(eqn):
            found = first_constraint(body)
            if found is not None:
                return found
    return None


def dropped(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn``'s operands, the constraint taken out; warns with the line that wrote it."""
    warnings.warn(
        f"autopar ignores the with_sharding_constraint at {compat.source_line(eqn)}: it lays out "
        "every value itself (see train_step.plan(...) for the layouts it chose)",
        stacklevel=2,
    )
    return list(invals)


def rebind(eqn: Any, invals: Sequence[Any], run: Run) -> list[Any] | None:
    """``eqn`` applied to ``invals`` with the constraints in its bodies dropped (each body
    evaluated by ``run``); None when its bodies hold none."""
    inner = [c for c in map(first_constraint, compat.bodies(eqn)) if c is not None]
    if not inner:
        return None
    branches = compat.cond_branches(eqn)
    if branches is not None:
        fns = [functools.partial(run, body, consts) for body, consts in branches]
        return list(jax.lax.switch(invals[0], fns, *invals[1:]))
    loop = compat.while_body(eqn)
    body = loop[0] if loop is not None else compat.inlinable_body(eqn)
    if body is None or first_constraint(body) is not inner[0]:
        raise ValueError(
            f"The with_sharding_constraint at {compat.source_line(inner[0])} is inside a "
            f"{eqn.primitive.name} that autopar cannot trace again without it. autopar lays out "
            "every value itself: remove the constraint (or move it out of the "
            f"{eqn.primitive.name})."
        )
    return compat.bind_with_body(eqn, body, functools.partial(run, body, []), invals)


def bound_to_meshes(jaxpr: Any) -> list[tuple[Any, Mesh]]:
    """The equations in ``jaxpr`` or its bodies (a grad region's too) that run on a mesh of the
    step's own (``shard_map``), each with that mesh."""
    found = []
    for eqn in jaxpr.eqns:
        found += [(eqn, m) for m in eqn.params.values() if isinstance(m, Mesh) and not m.empty]
        for body in compat.bodies(eqn):
            found += bound_to_meshes(body)
    return found


def check_meshes(found: Sequence[tuple[Any, Mesh]], stage_devices: Sequence[Sequence[int]]) -> None:
    """Raises unless the plan is one stage on exactly the devices of each of the step's meshes.

    Raises:
      ValueError: naming the equation's line, its mesh's devices and the plan's stages.
    """
    for eqn, mesh in found:
        ids = sorted(d.id for d in mesh.devices.flat)
        if len(stage_devices) != 1 or sorted(stage_devices[0]) != ids:
            raise ValueError(
                f"The {eqn.primitive.name} at {compat.source_line(eqn)} runs on a mesh of its own, devices "
                f"{ids}, but the plan's {len(stage_devices)} stage(s) run on devices "
                f"{[list(s) for s in stage_devices]}: a step that binds a mesh runs as one stage on "
                "exactly its devices. Pass num_stages=1 (or 'auto') and devices= those devices, or "
                f"take the {eqn.primitive.name} out of the step."
            )
