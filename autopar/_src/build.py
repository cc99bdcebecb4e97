"""From a step, its arguments and the options of :func:`~autopar.autoparallel` to a compiled
:class:`~autopar._src.driver.Executable`: the plan, the program, each stage's layouts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from autopar._src import (
    autoplan,
    driver,
    early_draws,
    intra_op,
    memory,
    microbatch_checks,
    microbatch_draws,
    microbatch_keys,
    multihost,
    partition,
    planner,
    planning,
    profile,
    user_constraints,
)
from autopar._src.cluster import ClusterSpec
from autopar._src.plan import Plan
from autopar._src.profile import LayerProfile
from autopar._src.program import Program
from autopar._src.sharding_ilp import NoLayoutFitsError
from autopar._src.trace import TracedStep, TraceOptions

if TYPE_CHECKING:
    from autopar._src.options import Options


MEMORY_REPLANS = 3
"""Times the stage search runs again, for a device with less memory, when the sharding ILP
finds no layout of a stage it chose that fits the memory its model left, or the compiled
program of a stage does not fit the device (see :func:`check_fits`)."""

CHECK_FRACTION = 0.5
"""Plans whose memory model puts a stage at this fraction of a device or more are compiled
and checked against the device before they run."""


def executable(fn: Callable[..., Any], args: tuple[Any, ...], opts: Options) -> driver.Executable:
    """Plans, partitions and compiles ``fn`` for ``args`` under ``opts``.

    Raises:
      ValueError: for invalid arguments or options.
      NoFeasiblePlanError: if no plan fits the cluster's memory.
      NoLayoutFitsError: if a stage has no layout that fits, or its compiled program does not
        fit the device (see :func:`check_fits`; for ``num_stages="auto"``, after
        :data:`MEMORY_REPLANS` searches for a device with less memory each).
    """
    devices = list(opts.devices) if opts.devices is not None else jax.devices()
    nmb = opts.plan.num_microbatches if opts.plan is not None else opts.num_microbatches
    batch_ids, batch_size = batch_leaves(
        args, opts.batch_argnums, 1 if nmb == "auto" else nmb, planned=opts.plan is not None
    )
    both = set(_leaf_ids(args, opts.donate_argnums)) & set(batch_ids)
    if both:
        raise ValueError(
            f"donate_argnums={opts.donate_argnums} and batch_argnums={opts.batch_argnums} name the same "
            f"argument of the {len(args)} given; the batch is split into microbatches and cannot be donated"
        )
    spec = opts.cluster if opts.cluster is not None else planning.cluster_for(devices)
    assert isinstance(spec, ClusterSpec), "Options parses a cluster's name"
    searched = spec  # the cluster the stage search plans for
    failed: NoLayoutFitsError | None = None
    # The step at the whole batch, once per plan's cuts (see microbatch_checks.per_example_outputs): its
    # region is compared with the plan's equation by equation, so it is cut in the same places.
    whole_batch = functools.cache(
        lambda cuts: planning.trace_at(
            fn, args, batch_ids, batch_size, TraceOptions(num_layers=len(cuts) + 1, cuts=cuts)
        )
    )
    for attempt in range(MEMORY_REPLANS + 1):
        try:
            step, plan = _plan(fn, args, opts, searched, devices, batch_ids, batch_size)
        except ValueError as e:
            if failed is None:
                raise
            raise failed from e  # no plan for the smaller device: the stage's error is the cause
        user_constraints.check_meshes(
            user_constraints.bound_to_meshes(step.jaxpr), [st.device_ids for st in plan.stages]
        )
        if jax.process_count() > 1:  # process 0's plan on every process (see multihost)
            agreed = Plan.from_json(multihost.agree(plan.to_json().encode()).decode())
            if agreed != plan:
                step, plan = planning.reuse_plan(
                    fn, args, plan=agreed, batch_ids=batch_ids, batch_size=batch_size, devices=devices
                )
        multi = plan.num_microbatches > 1 and step.region_index() is not None
        # Draws that follow the batch are jax.jit's where they can be; in the loss function,
        # else from folded keys, and before it, else refused.
        early = (
            early_draws.find(step, whole_batch(tuple(plan.cuts)), plan.num_microbatches) if multi else None
        )
        per_example, stats, summed = microbatch_checks.per_example_outputs(
            step,
            functools.partial(whole_batch, tuple(plan.cuts)),
            batch_ids=batch_ids,
            num_microbatches=plan.num_microbatches,
            drawn=early.top if early is not None else frozenset(),
        )
        draws = (
            microbatch_draws.find(
                step,
                whole_batch(tuple(plan.cuts)),
                plan.num_microbatches,
                early.index if early is not None else None,
            )
            if multi
            else None
        )
        drawing = (
            microbatch_keys.drawing_per_example(step, whole_batch(tuple(plan.cuts)))
            if multi and draws is None
            else frozenset()
        )
        meshes = driver.stage_meshes(plan, devices)
        mb = batch_size // plan.num_microbatches if batch_size else 0
        program = partition.build_program(
            step,
            plan,
            batch_ids,
            mb,
            per_example,
            drawing,
            whole_batch(tuple(plan.cuts)) if multi else None,
            stats,
            draws,
            early,
            summed,
        )
        # The memory model's parts of each layer (none for a step without autopar's gradient).
        prof = profile.layer_profile(step, tuple(batch_ids)) if step.region_index() is not None else None
        try:
            shardings = _layouts(step, program, plan, spec, prof, devices[0].platform, opts)
            if searched is not spec:
                plan = dataclasses.replace(plan, memory_budget=float(spec.device.memory_bytes))
            if shardings:
                plan = planning.describe_layouts(
                    plan, step, args, [None if s is None else s.specs for s in shardings]
                )
            exe = driver.Executable(
                program=program,
                plan=plan,
                step=step,
                meshes=meshes,
                batch_leaf_ids=tuple(batch_ids),
                donated_leaf_ids=_leaf_ids(args, opts.donate_argnums),
                shardings=shardings,
            )
            # Once memory proved tight, every later plan is checked.
            check_fits(exe, spec.device.memory_bytes, prof=prof, force=failed is not None)
            break
        except NoLayoutFitsError as e:
            if opts.plan is not None or opts.num_stages != "auto" or attempt == MEMORY_REPLANS:
                raise
            failed = e
            # The stage search's model (parameters and stashes split over the model axis, XLA's
            # temporaries as the largest backward value) was short for a stage: search again as
            # if the device had that much less memory.
            shrink = min(0.9, max(e.budget / e.least, 0.5)) if e.least > 0 else 0.9
            device = dataclasses.replace(
                searched.device, memory_bytes=int(searched.device.memory_bytes * shrink)
            )
            searched = dataclasses.replace(searched, device=device)
    return exe


def check_fits(
    exe: driver.Executable,
    device_bytes: float,
    *,
    prof: LayerProfile | None = None,
    force: bool = False,
) -> None:
    """Checks the compiled program of each stage against the device, where the memory model
    puts some stage at :data:`CHECK_FRACTION` of it or more, or ``force`` (XLA keeps what it
    compiles here for the first step). The model's figure is the stage search's and, given the
    layers' profile ``prof``, :func:`~autopar._src.memory.predicted_peak` of the plan as laid out
    (a plan with a fixed stage count has only that one).

    Raises:
      NoLayoutFitsError: naming the first stage whose compiled program peaks above
        ``device_bytes`` (its ``least`` is that peak).
    """
    stages = range(exe.plan.num_stages)
    predicted = max(st.memory_bytes for st in exe.plan.stages)
    if prof is not None:
        predicted = max(predicted, *(memory.predicted_peak(exe, s, prof) for s in stages))
    if not device_bytes or (predicted < CHECK_FRACTION * device_bytes and not force):
        return
    for s, st in enumerate(exe.plan.stages):
        trace = memory.compiled_peak(exe, s)
        if trace.peak > device_bytes:
            raise NoLayoutFitsError(
                f"{st.label(s)} peaks at "
                f"{trace.peak / 2**20:.3g} MiB per device in its compiled program, above the device's "
                f"{device_bytes / 2**20:.3g} MiB (during {trace.at_task}, with "
                f"{trace.temporaries / 2**20:.3g} MiB of XLA's temporaries). Use more devices or "
                "microbatches, or a cluster with more memory.",
                budget=device_bytes,
                least=trace.peak,
            )


def _plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    opts: Options,
    spec: ClusterSpec,
    devices: list[Any],
    batch_ids: list[int],
    batch_size: int,
) -> tuple[TracedStep, Plan]:
    """The traced step and its plan: ``opts.plan`` reused, searched for ``spec``, or uniform."""
    nmb = opts.plan.num_microbatches if opts.plan is not None else opts.num_microbatches
    common: dict[str, Any] = dict(batch_ids=batch_ids, batch_size=batch_size, devices=devices)
    if opts.plan is not None:
        return planning.reuse_plan(fn, args, plan=opts.plan, **common)
    if opts.num_stages == "auto":
        measured: dict[str, Any] = {}
        if opts.cost_model == "measured":
            if jax.process_count() > 1:
                raise ValueError(
                    f"cost_model='measured' times candidate stages on one process's devices, but "
                    f"this run has {jax.process_count()} processes; use cost_model='analytic', or "
                    "plan on one process and pass the saved plan (plan=autopar.Plan.load(path))."
                )
            from autopar._src import measure

            directory = opts.cost_cache or measure.default_cache_dir()
            measured = dict(measured_devices=devices, cost_cache=measure.CostCache(directory))
        return autoplan.auto_plan(
            fn,
            args,
            num_microbatches=None if nmb == "auto" else nmb,
            schedule=opts.schedule,
            spec=spec,
            batch_ids=batch_ids,
            batch_size=batch_size,
            device_ids=[d.id for d in devices],
            tensor_parallel=opts.sharding == "auto",
            sharding_costs=opts.sharding == "auto",
            platform=devices[0].platform,
            **measured,
        )
    _check_num_stages(opts.num_stages, len(devices))
    if nmb == "auto":
        raise ValueError(
            "num_microbatches='auto' needs num_stages='auto' (the stage search chooses both); "
            f"with num_stages={opts.num_stages} give num_microbatches as an int."
        )
    return planning.uniform_plan(
        fn,
        args,
        num_stages=opts.num_stages,
        num_microbatches=nmb,
        schedule=opts.schedule,
        mesh_shape=opts.mesh_shape,
        **common,
    )


def _layouts(
    step: TracedStep,
    program: Program,
    plan: Plan,
    spec: ClusterSpec,
    prof: LayerProfile | None,
    platform: str,
    opts: Options,
) -> list[intra_op.StageSharding | None]:
    """Each stage's layouts from the sharding ILP; with ``sharding="data"``, around data
    parallelism's layouts of the stage inputs."""
    if opts.sharding == "data":
        return intra_op.solve_stages(step, program, plan, spec, platform=platform, data_parallel=True)
    # Each stage's ILP lays out its inputs, gradient sums and stashes in what the memory model
    # leaves of a device after the backward's transients (a step without autopar's gradient
    # has no layers to model: its one stage gets the device).
    budget = spec.device.memory_bytes * (1 - planner.MEMORY_HEADROOM)
    if prof is None:
        return intra_op.solve_stages(step, program, plan, spec, memory_budget=budget, platform=platform)
    rests = [planner.planned_peak(prof, plan, s).rest for s in range(plan.num_stages)]
    for s, (st, rest) in enumerate(zip(plan.stages, rests, strict=True)):
        if rest >= budget:
            raise NoLayoutFitsError(
                f"{st.label(s)} has no room for its inputs: its backward's transients (the largest "
                f"value it makes and one microbatch's gradients) take {rest / 2**20:.3g} MiB per "
                f"device of the {budget / 2**20:.3g} MiB the device leaves after the memory model's "
                f"{planner.MEMORY_HEADROOM:.0%} margin. Use more devices per stage or microbatches, "
                "or a cluster with more memory.",
                budget=budget,
                least=rest,
            )
    budgets = [budget - rest for rest in rests]
    return intra_op.solve_stages(step, program, plan, spec, memory_budget=budgets, platform=platform)


def _leaf_ids(args: tuple[Any, ...], argnums: tuple[int, ...]) -> tuple[int, ...]:
    """Flat leaf indices of the positional arguments ``argnums``.

    Raises:
      ValueError: if an argnum is out of range.
    """
    ids: list[int] = []
    offset = 0
    wanted = set()
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(f"argnum {a} is out of range for a step called with {len(args)} arguments")
        wanted.add(a % len(args))
    for pos, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if pos in wanted:
            ids.extend(range(offset, offset + n))
        offset += n
    return tuple(ids)


def batch_leaves(
    args: tuple[Any, ...], argnums: tuple[int, ...], nmb: int, *, planned: bool = False
) -> tuple[list[int], int]:
    """Flat indices of the batch leaves and the batch size; validates both (``planned``: the
    microbatch count is a given plan's)."""
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(
                f"batch_argnums={argnums} names argument {a}, but the step got {len(args)} "
                "positional arguments"
            )
    wanted = {a % len(args) for a in argnums}
    ids: list[int] = []
    sizes: dict[int, str] = {}
    offset = 0
    for pos, arg in enumerate(args):
        path_leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        if pos in wanted:
            for k, (path, leaf) in enumerate(path_leaves):
                shape = np.shape(leaf)
                name = f"argument {pos}{jax.tree_util.keystr(path)}"
                if len(shape) == 0:
                    raise ValueError(
                        f"Batch leaf {name} is a scalar; batch arguments must have a leading batch "
                        "dim. Is the batch another argument? batch_argnums names it (by default the "
                        "second: step(state, batch)). Move scalars out of batch_argnums."
                    )
                sizes.setdefault(shape[0], name)
                ids.append(offset + k)
        offset += len(path_leaves)
    if len(sizes) > 1:
        raise ValueError(
            f"Batch leaves disagree on the batch size: {sorted(sizes)} (e.g. {list(sizes.values())}); "
            "every leaf of the batch arguments needs the same leading dim, one row per example. Give "
            "a leaf with several rows per example its own dim for them in the data pipeline (five "
            "captions per image as [batch, 5, ...], not [batch * 5, ...]). Pass leaves that are not per "
            "example (a graph batch's concatenated nodes and edges, which "
            "index each other) in an argument outside batch_argnums (batch_argnums=() for none): "
            "they are then not cut into microbatches."
        )
    if 0 in sizes:
        raise ValueError(f"The batch is empty: {sizes[0]} has 0 rows; pass at least one example.")
    size = next(iter(sizes), 0)
    if size and size % nmb:
        fix = (
            f"use a batch size divisible by {nmb}, or plan again for this batch"
            if planned
            else f"choose a num_microbatches that divides {size}"
        )
        source = "the plan's num_microbatches" if planned else "num_microbatches"
        raise ValueError(f"The batch size {size} is not divisible by {source}={nmb}; {fix}.")
    return ids, size


def _check_num_stages(num_stages: int, num_devices: int) -> None:
    if num_stages > num_devices:
        raise ValueError(
            f"num_stages={num_stages} is more than the {num_devices} devices; use at most {num_devices}."
        )
    if num_devices % num_stages:
        raise ValueError(
            f"{num_devices} devices cannot be split evenly among num_stages={num_stages}; choose a "
            f"num_stages that divides {num_devices}, or pass devices= with a multiple of {num_stages}."
        )
