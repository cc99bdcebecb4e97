"""From a step and its arguments to a traced step and a plan.

Three ways: reuse a given plan (checked against the step and the devices), split
evenly into a given number of stages, or (``num_stages="auto"``,
:mod:`autopar._src.autoplan`) let the clustering pick the layers and the stage DP
pick stages, submeshes and, if asked, the number of microbatches. This module holds
the first two and the helpers all three share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar._src import (
    batch_statistics,
    compat,
    cost,
    example_mixing,
    profile,
    region_outputs,
    trace,
    whole_batch,
)
from autopar._src import cluster as cluster_mod
from autopar._src.plan import DATA_AXIS, Plan, StagePlan
from autopar._src.schedule import ScheduleName


def _abstract(x: Any, rows: int | None) -> Any:
    aval = jax.typeof(x)
    shape = tuple(aval.shape) if rows is None else (rows, *aval.shape[1:])
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type)


def trace_at(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_ids: Sequence[int],
    rows: int,
    options: trace.TraceOptions,
) -> trace.TracedStep:
    """Traces ``fn`` abstractly with the batch leaves cut to ``rows`` rows."""
    leaves, in_tree = jax.tree.flatten(args)
    ids = set(batch_ids)
    abstract = [_abstract(x, rows if i in ids else None) for i, x in enumerate(leaves)]
    return trace.trace_step(fn, jax.tree.unflatten(in_tree, abstract), options)


def step_profile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_ids: Sequence[int],
    rows: int,
    step: trace.TracedStep,
) -> profile.LayerProfile:
    """The layer profile of ``step`` (``fn`` traced by :func:`trace_at` at ``rows``), its fixed
    traffic read off a second trace at twice the rows with the same layer cuts (abstract:
    nothing is allocated).

    Raises:
      ValueError: if the step has no grad region.
    """
    if rows <= 0 or not batch_ids:
        return profile.layer_profile(step, tuple(batch_ids))
    cuts = region_layers(step)[0]
    options = trace.TraceOptions(num_layers=len(cuts) + 1, cuts=cuts)
    doubled = trace_at(fn, args, batch_ids, 2 * rows, options)
    return profile.layer_profile(step, tuple(batch_ids), doubled=doubled)


def region_layers(step: trace.TracedStep) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    """``(cuts, layer FLOPs, fingerprint)`` of the step's grad region (none: one empty layer)."""
    at = step.region_index()
    if at is None:
        return (), (0.0,), ""
    info = step.jaxpr.eqns[at].params["info"]
    return info.cuts, info.layer_flops, info.fingerprint


def stage_details(
    step: trace.TracedStep,
    args: tuple[Any, ...],
    prof: profile.LayerProfile | None,
    layers: tuple[int, int],
    spec_text: str,
) -> dict[str, Any]:
    """Source span and largest parameters of the stage holding ``layers``."""
    at = step.region_index()
    if at is None or prof is None:
        return {}
    sources = step.jaxpr.eqns[at].params["info"].layer_sources
    start, stop = layers
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    index = {v: i for i, v in enumerate(step.arg_vars)}
    owned = [v for v, layer in prof.param_layer.items() if start <= layer < stop and v in index]
    owned.sort(key=lambda v: (-cost.aval_bytes(v.aval), index[v]))
    largest = tuple(f"{paths[index[v]]} {v.aval.dtype}{list(v.aval.shape)} {spec_text}" for v in owned[:3])
    return {"source": (sources[start][0], sources[stop - 1][1]), "largest_params": largest}


def describe_layouts(
    plan: Plan, step: trace.TracedStep, args: tuple[Any, ...], specs: Sequence[dict[Any, Any] | None]
) -> Plan:
    """``plan`` with each stage's largest parameters shown in the layouts ``specs`` gives them."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    by_path = dict(zip(paths, step.arg_vars, strict=True))
    stages = []
    for st, chosen in zip(plan.stages, specs, strict=True):
        described = []
        for text in st.largest_params:
            v = by_path.get(text.split(" ")[0])
            if chosen is None or v is None or v not in chosen:
                described.append(text)
                continue
            spec = chosen[v]
            layout = "replicated" if all(a is None for a in spec) else str(jax.sharding.PartitionSpec(*spec))
            described.append(f"{text.split(' ')[0]} {v.aval.dtype}{list(v.aval.shape)} {layout}")
        stages.append(dataclasses.replace(st, largest_params=tuple(described)))
    return dataclasses.replace(plan, stages=tuple(stages))


def require_region(step: trace.TracedStep, num_microbatches: int, num_stages: int) -> None:
    if step.region_index() is None and (num_microbatches > 1 or num_stages > 1):
        nested = _nested_region(step.jaxpr)
        if nested is not None:
            raise ValueError(
                f"num_microbatches={num_microbatches} and num_stages={num_stages} need "
                "autopar.value_and_grad (or autopar.grad) called once at the top level of the step, "
                f"but the step calls it inside {nested.primitive.name} (at {compat.source_line(nested)}), "
                "e.g. a loop accumulating gradients, where it cannot be pipelined. Call it once on the "
                "whole batch (num_microbatches does the accumulation), or use num_microbatches=1 and "
                "num_stages=1."
            )
        raise ValueError(
            f"num_microbatches={num_microbatches} and num_stages={num_stages} need the step to compute "
            "its gradient with autopar.value_and_grad or autopar.grad at the top level of the step (it "
            "has none there: e.g. it uses jax.grad, or autopar.grad under jax.vmap); switch to "
            "autopar's on the whole batch, or use num_microbatches=1 and num_stages=1."
        )


def _nested_region(jaxpr: Any) -> Any:
    """The top-level equation of ``jaxpr`` whose body holds a grad region, if any."""
    for eqn in jaxpr.eqns:
        bodies = compat.bodies(eqn)
        while bodies:
            body = bodies.pop()
            if trace.find_regions(body):
                return eqn
            for inner in body.eqns:
                bodies += compat.bodies(inner)
    return None


def per_example_outputs(
    step: trace.TracedStep,
    whole_batch: Callable[[], trace.TracedStep],
    *,
    batch_ids: Sequence[int],
    num_microbatches: int,
) -> tuple[dict[int, int], batch_statistics.Statistics]:
    """The outputs of the step's gradient region that hold a value per example, each with its
    batch dim: aux outputs such as the logits, and the gradients of batch inputs. Microbatches
    concatenate these along it (gradients divided by ``num_microbatches``, as the mean over
    microbatches is). The other outputs are reduced over the batch, and microbatches average
    them (integers, booleans and keys: the first microbatch's).

    ``step`` is traced at one microbatch; with several, ``whole_batch()`` gives the step traced
    at the whole batch (:func:`trace_at`, at the same cuts: the regions are compared equation by
    equation) to compare the outputs' shapes, and the code that runs once per step, which must
    not depend on the batch's shape.

    Returns:
      ``{index into the region's outputs: batch dim}``, and the statistics of the batch that the
      loss function reads (:func:`~autopar._src.batch_statistics.find`), made once per step.

    Raises:
      ValueError: naming a region output whose shape for the batch is not its shape for one
        microbatch with one dim ``num_microbatches`` times as long, or the source line of
        once-per-step code that reads the batch's shape.
    """
    at = step.region_index()
    if num_microbatches == 1 or at is None:
        return {}, batch_statistics.NONE
    whole = whole_batch()
    region = step.jaxpr.eqns[at]
    num_aux = region.params["info"].num_aux
    whole_outs = whole.jaxpr.eqns[whole.region_index()].outvars
    dims = {}
    for i, (part, full) in enumerate(zip(region.outvars, whole_outs, strict=True)):
        if i == 0 or part.aval.shape == full.aval.shape:
            continue
        grown = [d for d, (a, b) in enumerate(zip(part.aval.shape, full.aval.shape, strict=True)) if a != b]
        if len(grown) != 1 or full.aval.shape[grown[0]] != part.aval.shape[grown[0]] * num_microbatches:
            raise ValueError(
                f"{region_outputs.named(i, num_aux)} of the loss function is "
                f"{full.aval.str_short()} for the batch but "
                f"{part.aval.str_short()} for one of num_microbatches={num_microbatches}: neither "
                "reduced over the batch (averaged over microbatches) nor one value per example along "
                "one dim (concatenated). Return it reduced over the batch or per example, compute it "
                "outside the step, or use num_microbatches=1."
            )
        dims[i] = grown[0]
    # Code reading the per-example outputs is refused later, naming the output.
    seeds = (_batch_values(step, batch_ids, dims), _batch_values(whole, batch_ids, dims))
    stats = batch_statistics.find(step, whole, {step.arg_vars[i] for i in batch_ids}, num_microbatches)
    figures = batch_statistics.unread(step, stats)
    example_mixing.require_examples_apart(step, whole, batch_ids, num_microbatches, figures)
    example_mixing.require_examples_apart_in_loss(step, whole, num_microbatches, set(stats.values))
    averaged = [i for i in range(1 + num_aux) if i not in dims]
    batch_statistics.require_linear_in_shares(step, stats, averaged)
    _require_batch_free_once_per_step((step, whole), seeds, num_microbatches, figures)
    region_outputs.require_combinable(step, whole, batch_ids, dims, num_microbatches)
    return dims, stats


def _batch_values(step: trace.TracedStep, batch_ids: Sequence[int], dims: dict[int, int]) -> set[Any]:
    """The batch's inputs and the region's per-example outputs, as variables of ``step``."""
    at = step.region_index()
    outs = step.jaxpr.eqns[at].outvars if at is not None else []
    return {step.arg_vars[i] for i in batch_ids} | {outs[i] for i in dims}


def _require_batch_free_once_per_step(
    steps: tuple[trace.TracedStep, trace.TracedStep],
    seeds: tuple[set[Any], set[Any]],
    num_microbatches: int,
    figures: set[Any],
) -> None:
    """Checks that the equations before the grad region that read no value of one microbatch
    (``seeds`` and what derives from them) and that the microbatches read are the same in the
    step traced at one microbatch as at the whole batch (``steps``): a batch shape read there
    (``jnp.arange(x.shape[0])`` as the examples' positions) would be one microbatch's. Where the
    rest differs (an examples-seen counter updated before the loss), it runs once per step at the
    whole batch (:mod:`~autopar._src.whole_batch`), as the code after the region does, and so does
    what only makes ``figures``, statistics of the batch (the element count ``jnp.std`` divides
    by)."""
    mine, theirs = (_once_per_step(s, seed) for s, seed in zip(steps, seeds, strict=True))
    step = steps[0]
    at = step.region_index()
    # What the step reads of the code before the region, but for the statistics' makings, and of
    # that, what the microbatches read (``feeding``). The rest runs once per step as its twin at
    # the whole batch (whole_batch.py), given the two traces' equations pair up.
    eqns = step.jaxpr.eqns
    read = _reading(step, [*(a for e in eqns[at:] for a in e.invars), *step.jaxpr.outvars], figures, True)
    derived = step.derived(seeds[0])
    per_microbatch = [
        e for e in eqns[:at] if any(not compat.is_literal(a) and a in derived for a in e.invars)
    ]
    feeding = _reading(step, [a for e in (*per_microbatch, eqns[at]) for a in e.invars], figures, False)
    paired = whole_batch.twins(*steps) is not None
    fills = _microbatch_fills(step, seeds[0])
    for k, eqn in enumerate(mine):
        other = theirs[k] if k < len(theirs) else None
        if other is not None and id(eqn) in fills and _fill_of_the_batch(eqn, other, num_microbatches):
            continue
        if (
            (other is None or str(eqn) != str(other))
            and id(eqn) in read
            and (id(eqn) in feeding or not paired)
        ):
            cause, fix = (
                (
                    "it draws random values in the batch's shape (e.g. a diffusion loss's noise), "
                    "which is one microbatch's there",
                    "Draw them with the data and pass them in the batch (then equal to jax.jit), "
                    "draw them inside the loss function (each microbatch draws its own), or use "
                    "num_microbatches=1.",
                )
                if eqn.primitive.name == "random_bits"
                else (
                    "it reads the batch's shape (e.g. x.shape[0]), which is one microbatch's there, "
                    "or a value Python makes while tracing",
                    "Read it inside the loss function and return what needs it as aux, pass it to "
                    "the step as an argument, or use num_microbatches=1.",
                )
            )
            raise ValueError(
                f"The step's code outside the loss function differs between one microbatch and the "
                f"whole batch (at {compat.source_line(eqn)}: {str(eqn).splitlines()[0]!r} for one of "
                f"num_microbatches={num_microbatches}, "
                f"{'nothing' if other is None else repr(str(other).splitlines()[0])} for the batch): "
                f"{cause}. {fix}"
            )
    if len(theirs) > len(mine):
        raise ValueError(
            f"The step's code outside the loss function differs between one microbatch and the "
            f"whole batch (at {compat.source_line(theirs[len(mine)])}, only for the batch): it "
            "reads the batch's shape. Read it inside the loss function, pass it to the step as an "
            "argument, or use num_microbatches=1."
        )


def _reading(step: trace.TracedStep, ends: Sequence[Any], figures: set[Any], effects: bool) -> set[int]:
    """The ``id`` of each equation before the grad region that makes a value of ``ends`` or that
    such an equation reads, past ``figures`` (with ``effects``: and those without outputs, a
    ``jax.debug.print``)."""
    live = {a for a in ends if not compat.is_literal(a)} - figures
    found = set()
    for e in reversed(step.jaxpr.eqns[: step.region_index()]):
        if any(v in live for v in e.outvars) or (effects and not e.outvars):
            found.add(id(e))
            live.update(a for a in e.invars if not compat.is_literal(a) and a not in figures)
    return found


def _microbatch_fills(step: trace.TracedStep, seeds: set[Any]) -> set[int]:
    """The ``id`` of each equation before the grad region that broadcasts and whose values only
    code run per microbatch reads (before the region, or the region): at one
    microbatch's shape, such a fill (``jnp.zeros(x.shape[0])`` as the update of
    ``x.at[:, 0].set(0.0)``) is each microbatch's part of the whole batch's, the same value
    everywhere."""
    at = step.region_index()
    eqns = step.jaxpr.eqns
    derived = step.derived(seeds)
    per_microbatch = {
        id(e) for e in eqns[:at] if any(not compat.is_literal(a) and a in derived for a in e.invars)
    }
    per_microbatch.add(id(eqns[at]))
    readers: dict[Any, list[int]] = {}
    for e in eqns:
        for a in e.invars:
            if not compat.is_literal(a):
                readers.setdefault(a, []).append(id(e))
    returned = {v for v in step.jaxpr.outvars if not compat.is_literal(v)}
    return {
        id(e)
        for e in eqns[:at]
        if e.primitive.name == "broadcast_in_dim"
        and e.outvars[0] not in returned
        and all(r in per_microbatch for r in readers.get(e.outvars[0], []))
    }


def _fill_of_the_batch(eqn: Any, other: Any, nmb: int) -> bool:
    """Whether the broadcast ``eqn`` differs from ``other``, its twin at the whole batch, in dims
    per example alone, which it fills rather than takes from its operand (a new dim, or one of
    size 1 stretched: ``jnp.broadcast_to(jnp.arange(T)[None], ids.shape)``)."""
    grown = example_mixing.per_example_dims(eqn.outvars[0], other.outvars[0], nmb)
    same = [d for d in range(len(eqn.params["shape"])) if d not in grown]
    operand = getattr(eqn.invars[0].aval, "shape", ())
    taken = {d for k, d in enumerate(eqn.params["broadcast_dimensions"]) if operand[k] != 1}
    return (
        bool(grown)
        and not grown & taken
        and all(eqn.params["shape"][d] == other.params["shape"][d] for d in same)
    )


def _once_per_step(step: trace.TracedStep, seeds: set[Any]) -> list[Any]:
    """The equations before the grad region that read nothing derived from ``seeds`` (those
    run per microbatch, at the microbatch's shape by design)."""
    derived, at = step.derived(seeds), step.region_index()
    return [
        e
        for e in step.jaxpr.eqns[:at]
        if not any(not compat.is_literal(a) and a in derived for a in e.invars)
    ]


def uniform_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    devices: Sequence[Any],
    num_stages: int,
    num_microbatches: int,
    schedule: ScheduleName,
    mesh_shape: tuple[int, ...] | None = None,
) -> tuple[trace.TracedStep, Plan]:
    """``num_stages`` FLOP-balanced layers, one per stage, on equal submeshes.

    Each stage's logical mesh is ``mesh_shape`` (``(data,)`` or ``(data, model)``), by
    default all of its devices on ``"data"``.

    Raises:
      ValueError: if ``mesh_shape`` does not hold each stage's devices.
    """
    per = len(devices) // num_stages
    shape = (per,) if mesh_shape is None else tuple(mesh_shape)
    if math.prod(shape) != per:
        raise ValueError(
            f"mesh_shape={shape} holds {math.prod(shape)} devices but each of the {num_stages} stages "
            f"has {per}; choose a mesh_shape whose product is {per}"
        )
    axes = (DATA_AXIS, "model")[: len(shape)]
    rows = batch_size // num_microbatches if batch_size else 0
    step = trace_at(fn, args, batch_ids, rows, trace.TraceOptions(num_layers=num_stages))
    require_region(step, num_microbatches, num_stages)
    cuts, flops, fingerprint = region_layers(step)
    prof = profile.layer_profile(step, tuple(batch_ids)) if step.region_index() is not None else None
    stage_plans = tuple(
        StagePlan(
            layers=(i, i + 1),
            device_ids=tuple(d.id for d in devices[i * per : (i + 1) * per]),
            mesh_shape=shape,
            axis_names=axes,
            forward_flops=flops[i],
            **stage_details(step, args, prof, (i, i + 1), "replicated"),
        )
        for i in range(num_stages)
    )
    plan = Plan(
        num_microbatches=num_microbatches,
        schedule=schedule,
        cuts=cuts,
        layer_flops=flops,
        stages=stage_plans,
        fingerprint=fingerprint,
    )
    return step, plan


def reuse_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    devices: Sequence[Any],
    plan: Plan,
) -> tuple[trace.TracedStep, Plan]:
    """Traces the step at the plan's cuts and checks that the plan fits it.

    Raises:
      ValueError: if the step's layers or the devices do not match the plan.
    """
    rows = batch_size // plan.num_microbatches if batch_size else 0
    step = trace_at(fn, args, batch_ids, rows, trace.TraceOptions(num_layers=plan.num_layers, cuts=plan.cuts))
    require_region(step, plan.num_microbatches, plan.num_stages)
    cuts, flops, fingerprint = region_layers(step)
    if tuple(cuts) != tuple(plan.cuts) or fingerprint != plan.fingerprint:
        raise ValueError(
            f"The plan does not match this step: it was made for a loss with fingerprint "
            f"{plan.fingerprint!r}, this step's loss has {fingerprint!r} (other operations or parameter "
            "shapes). Plan again for this step."
        )
    ids = {d.id for d in devices}
    used = {d for st in plan.stages for d in st.device_ids}
    missing = sorted(used - ids)
    if missing:
        raise ValueError(
            f"The plan uses device ids {missing} that are not among the available devices {sorted(ids)}; "
            "plan again for these devices."
        )
    if ids - used:
        raise ValueError(
            f"The plan uses {len(used)} of the {len(ids)} devices (ids {sorted(used)}), leaving "
            f"{sorted(ids - used)} idle; pass devices= with just the plan's devices to run it on them, "
            "or plan again for all of them."
        )
    return step, plan


def cluster_for(devices: Sequence[Any]) -> cluster_mod.ClusterSpec:
    """The cluster spec preset matching ``devices``: one host per process (``jax.distributed``)
    that owns some of them.

    Raises:
      ValueError: for a device kind without a preset, or devices that do not come as equal
        runs of one process each (the stage search places stages on hosts by position).
    """
    name = cluster_mod.preset_name_for(devices[0])
    if name is None:
        raise ValueError(
            f"No cluster spec preset for device kind {devices[0].device_kind!r}; pass "
            "cluster=autopar.ClusterSpec(...) (or a preset) to autoparallel."
        )
    owners = [d.process_index for d in devices]
    hosts = list(dict.fromkeys(owners))
    per_host = len(devices) // len(hosts)
    if owners != [h for h in hosts for _ in range(per_host)]:
        raise ValueError(
            f"devices= lists devices of processes {owners}; each process must own as many of them, "
            "listed together (e.g. sorted(devices, key=lambda d: (d.process_index, d.id))), or pass "
            "cluster= to say how they form hosts."
        )
    return cluster_mod.preset(name, len(hosts), devices_per_host=per_host)
