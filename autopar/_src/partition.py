"""From a traced step and a plan to a program: tasks, transfers and frees.

Three explicit steps, as in SuperScaler:

1. *Transform*: every equation of the step gets a stage and a phase. Equations
   of the grad region belong to the layer they sit in (found from the boundary
   markers) and so to that layer's stage, forward or backward. Equations that
   depend on the batch run per microbatch; the rest run once per step, on the
   stage of their largest input (after the region) or of their first consumer.
2. *Space-time schedule*: the pipeline part follows the schedule's dispatch
   order; once-per-step equations are grouped by stage and by how many stage
   changes precede them, so their tasks form a DAG. Adjacent tasks of one stage
   are fused into one executable.
3. *Preserve dependencies*: a value read on another stage than the one that
   made it gets a transfer right after it is made; every buffer is freed after
   its last use.

Values are named by *keys* ``(var, tag)``: tag ``None`` for once-per-step
values, ``j`` for microbatch ``j``, ``("acc", j)`` for the running sum of a
region output after microbatch ``j``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar._src import (
    batch_statistics,
    compat,
    cost,
    fusion,
    layers,
    microbatch_draws,
    microbatch_keys,
    region_outputs,
    schedule,
    whole_batch,
)
from autopar._src.plan import Plan
from autopar._src.program import Key, Op, Program, Task, fuse_adjacent, wire
from autopar._src.trace import TracedStep


def _is_var(a: Any) -> bool:
    return not compat.is_literal(a)


def _eqn_invars(eqn: Any) -> list[Any]:
    return [a for a in eqn.invars if _is_var(a)]


def _eqn_outvars(eqn: Any) -> list[Any]:
    return [v for v in eqn.outvars if not compat.is_dropvar(v)]


def region_eqn_placement(region_jaxpr: Any, layer_to_stage: Sequence[int]) -> list[tuple[int, str]]:
    """``(stage, pass)`` of every equation of a differentiated, marked loss.

    Forward markers close layer ``index``; the last one closes the forward. Their
    transposes open the backward of layer ``index``.
    """
    num_layers = len(layer_to_stage)
    pass_, layer = "F", 0
    placement = []
    for eqn in region_jaxpr.eqns:
        placement.append((layer_to_stage[layer], pass_))
        if layers.is_boundary(eqn):
            index = eqn.params["index"]
            if eqn.params["kind"] == "fwd":
                pass_, layer = ("F", index + 1) if index < num_layers - 1 else ("B", num_layers - 1)
            else:
                pass_, layer = "B", index
    return placement


def layer_placement(step: TracedStep) -> tuple[int, Any, list[tuple[int, str]]]:
    """The grad region's equation index, its info, and the ``(layer, pass)`` of each of its
    equations.

    Raises:
      ValueError: if the step has no grad region.
    """
    at = step.region_index()
    if at is None:
        raise ValueError("The step has no autopar.value_and_grad; there are no layers.")
    info = step.jaxpr.eqns[at].params["info"]
    return at, info, region_eqn_placement(info.jaxpr, tuple(range(len(info.cuts) + 1)))


def _largest_input_stage(eqn: Any, producer_stage: dict[Any, int]) -> int | None:
    staged = [a for a in _eqn_invars(eqn) if a in producer_stage]
    if not staged:
        return None
    best = max(staged, key=lambda a: (cost.aval_bytes(a.aval), -producer_stage[a]))
    return producer_stage[best]


def build_program(
    step: TracedStep,
    plan: Plan,
    batch_leaf_ids: Sequence[int],
    microbatch_size: int,
    per_example: Mapping[int, int] | None = None,
    drawing: frozenset[int] = frozenset(),
    whole: TracedStep | None = None,
    stats: batch_statistics.Statistics = batch_statistics.NONE,
    draws: microbatch_draws.Draws | None = None,
    early: microbatch_draws.Draws | None = None,
    summed: frozenset[int] = frozenset(),
) -> Program:
    """Partitions a traced step according to ``plan``.

    ``per_example`` maps the region outputs that hold a value per example to their batch dim
    (:func:`autopar._src.microbatch_checks.per_example_outputs`): their microbatches' values are
    concatenated, as one value of the whole batch's shape; the other region outputs are
    averaged. ``drawing`` (:func:`autopar._src.microbatch_keys.drawing_per_example`) names the
    region inputs from which the loss draws random values per example: such a PRNG key is
    folded with each microbatch's index, unless ``draws``
    (:func:`autopar._src.microbatch_draws.find`) makes every such draw as ``jax.jit`` makes it
    for the whole batch; ``early`` (:func:`autopar._src.early_draws.find`) makes so the draws
    before the loss function, with the batch, per microbatch. ``whole`` is the step traced at
    the whole batch, for the code outside the region that needs the whole batch
    (:mod:`~autopar._src.whole_batch`); without it, with several microbatches, that code is left
    out (a program whose pipeline tasks alone are timed). ``stats`` are the loss function's
    statistics of the batch (:func:`autopar._src.batch_statistics.find`, from
    :func:`~autopar._src.microbatch_checks.per_example_outputs`): made once per step from the whole batch,
    every microbatch reads its share of them in place of its own. ``summed``: the region outputs
    (by index) that are sums over the examples, whose microbatches' values are added up; where
    the loss is one, each microbatch's backward starts from 1, not ``1 / num_microbatches``.

    Raises:
      ValueError: if code outside the region that needs the whole batch differs between the
        whole batch and one microbatch in more than shapes.
    """
    jaxpr = step.jaxpr
    eqns = jaxpr.eqns
    nmb = plan.num_microbatches
    if early is not None and nmb > 1:  # draws before the loss function read the microbatch's index
        eqns = [microbatch_draws.with_index(e, i, early) if i in early.top else e for i, e in enumerate(eqns)]
    region_at = step.region_index()

    # Which vars hold one value per microbatch: the batch and what derives from it before the
    # region (the region's outputs are averaged, so once per step). With several microbatches,
    # what the step makes from the batch after the region, or returns from before it, runs
    # once per step at the whole batch instead.
    batch_vars = {step.arg_vars[i] for i in batch_leaf_ids}
    per_mb: set[Any] = set(batch_vars) | ({early.index} if early is not None and nmb > 1 else set())
    for i, eqn in enumerate(eqns):
        if i != region_at and any(a in per_mb for a in _eqn_invars(eqn)):
            if region_at is not None and i > region_at and nmb > 1:
                continue
            per_mb.update(_eqn_outvars(eqn))
    joined: dict[Any, region_outputs.Joined] = {}  # per-example region outputs: their whole-batch value
    at_whole = whole_batch.NONE
    if region_at is not None and nmb > 1:
        joined = region_outputs.joined_outputs(step, per_example or {}, nmb)
        at_whole = whole_batch.find(step, whole, per_mb, joined, nmb)

    def okey(a: Any, j: int | None) -> Any:
        if not _is_var(a):
            return a
        if a in per_mb:
            return (a, 0 if j is None else j)
        return (a, None)

    stage_ops: dict[tuple[int, str], list[Any]] = {}  # (stage, pass) -> the region's equations
    # (stage, pass) -> (the region values it adds up, region output or part) to accumulate
    acc_specs: dict[tuple[int, str], list[tuple[tuple[Any, ...], Any]]] = {}
    gradients: set[Any] = set()  # accumulated sums that are their value: gradients, summed outputs
    splits: dict[Any, region_outputs.SplitSum] = {}  # region outputs added up once per step
    made_in: dict[Any, tuple[int, str]] = {}  # region values: the (stage, pass) that makes them
    producer_stage: dict[Any, int] = {}
    consumer_stages: dict[Any, set[int]] = {}
    rkey = None
    whole_stats: dict[Any, Key] = {}  # region outputs -> the statistic's whole value they return
    folded: dict[Any, microbatch_keys.Folded] = {}
    index_stages: set[int] = set()  # the stages whose region equations read the microbatch's index
    if region_at is not None:
        region = eqns[region_at]
        info = region.params["info"]
        rj = info.jaxpr
        rmap = dict(zip([*rj.constvars, *rj.invars], region.invars, strict=True))

        # With several microbatches each reads its own fold of a once-per-step PRNG key.
        folded = microbatch_keys.keys_to_fold(rj, rmap, per_mb, drawing) if nmb > 1 and draws is None else {}

        def rkey(a: Any, j: int) -> Any:  # noqa: F811
            if not _is_var(a):
                return a
            if a in stats.values:
                return stats.values[a]
            if a in rmap:
                outer = rmap[a]
                if _is_var(outer) and outer in stats.values:
                    return stats.values[outer]
                return (folded[outer].var, j) if _is_var(outer) and outer in folded else okey(outer, j)
            return (a, j)

        placement = region_eqn_placement(rj, plan.layer_to_stage())
        for at, (eqn, where) in enumerate(zip(rj.eqns, placement, strict=True)):
            if draws is not None and nmb > 1 and at in draws.top:  # reads the microbatch's index
                eqn = microbatch_draws.with_index(eqn, at, draws)
                index_stages.add(where[0])
            stage_ops.setdefault(where, []).append(
                layers.with_seed_scale(eqn, 1.0 if 0 in summed else 1.0 / nmb)
            )
            for v in _eqn_outvars(eqn):
                made_in[v] = where
            for a in _eqn_invars(eqn):
                if a in rmap and _is_var(rmap[a]):
                    consumer_stages.setdefault(rmap[a], set()).add(where[0])
        last_fwd = (plan.num_stages - 1, "F")
        # Aux outputs that are a statistic a microbatch reads a share of (a token count): the
        # whole batch's value, made once per step.
        for i, (rv, ov) in enumerate(zip(rj.outvars, region.outvars, strict=True)):
            origin = region_outputs.before_boundaries(rj, rv)
            if (
                0 < i <= info.num_aux
                and nmb > 1
                and _is_var(origin)
                and (origin in stats.shares or origin in stats.unshared)
            ):
                whole_stats[ov] = stats.wholes[origin]
        pairs = [
            (rv, ov)
            for rv, ov in zip(rj.outvars, region.outvars, strict=True)
            if not compat.is_dropvar(ov) and ov not in joined and ov not in whole_stats
        ]
        splits = region_outputs.split_sums(rj, pairs, made_in) if nmb > 1 else {}
        hoisted = {id(e) for split in splits.values() for e in split.adds}
        stage_ops = {where: [e for e in ops if id(e) not in hoisted] for where, ops in stage_ops.items()}
        for i, (rv, ov) in enumerate(zip(rj.outvars, region.outvars, strict=True)):
            if compat.is_dropvar(ov):
                continue
            if ov in whole_stats:
                producer_stage[ov] = plan.num_stages - 1
                continue
            where = made_in.get(rv, last_fwd) if _is_var(rv) else last_fwd
            if i > info.num_aux or i in summed:
                gradients.add(ov)
            if ov in splits:  # each part summed where it is made, added once per step
                for values, acc in splits[ov].parts:
                    acc_specs.setdefault(made_in[values[0]], []).append((values, acc))
                    if i > info.num_aux or i in summed:
                        gradients.add(acc)
                producer_stage[ov] = where[0]
                continue
            acc_specs.setdefault(where, []).append(((rv,), ov))
            producer_stage[ov] = where[0]
            if _is_var(rv) and rv in rmap and _is_var(rmap[rv]):
                consumer_stages.setdefault(rmap[rv], set()).add(where[0])

    # Stages of the equations outside the region.
    outer = [i for i in range(len(eqns)) if i != region_at]

    # Per-microbatch equations before the region run inside the forward tasks, but for those
    # that only make values for the code at the whole batch.
    in_forward = {
        i
        for i in outer
        if region_at is not None and i < region_at and any(v in per_mb for v in _eqn_outvars(eqns[i]))
    }
    if at_whole.again:
        in_forward -= set(at_whole.again) - whole_batch.feeding(step, in_forward)

    def reads(i: int) -> list[Any]:
        """What equation ``i`` reads where it runs: at the whole batch, not the microbatches, but
        for one made again there that also runs per microbatch."""
        return [a for a in _eqn_invars(eqns[i]) if i not in at_whole or i in in_forward or a not in per_mb]

    stage_of: dict[int, int] = {}
    for i in outer:
        if region_at is not None and i > region_at:
            st = _largest_input_stage(eqns[i], producer_stage)
            if st is not None:
                stage_of[i] = st
                for v in _eqn_outvars(eqns[i]):
                    producer_stage[v] = st
    for i in stage_of:
        for a in reads(i):
            consumer_stages.setdefault(a, set()).add(stage_of[i])
    for i in reversed(outer):
        if i in stage_of:
            continue
        stages = set().union(*(consumer_stages.get(v, set()) for v in _eqn_outvars(eqns[i])))
        # Made for the step's outputs only: before the gradient on the first stage, after it on
        # the last, beside the loss, so that outputs the step updates together (a metric's total
        # from the loss and its count) are on one stage and mix eagerly.
        after = region_at is not None and i > region_at
        st = min(stages) if stages else (plan.num_stages - 1 if after else 0)
        stage_of[i] = st
        for a in reads(i):
            consumer_stages.setdefault(a, set()).add(st)

    if early is not None and nmb > 1:
        index_stages.update(stage_of[i] for i in early.top)
    once = [i for i in outer if i not in in_forward and i not in at_whole.again]
    # made_by[var] = (level, stage) of the once-per-step op that makes it. Region
    # outputs are finished (averaged) at level 0 of the post phase on their stage.
    made_by: dict[Any, tuple[int, int]] = {
        ov: (0, st)
        for ov, st in producer_stage.items()
        if region_at is not None and ov in set(eqns[region_at].outvars)
    }
    for ov, split in splits.items():  # after the parts' finished sums, on the stage of the last addition
        st = producer_stage[ov]
        lv = max(int(made_in[values[0]][0] != st) for values, _ in split.parts)
        made_by[ov] = (lv, st)
    level: dict[int, int] = {}
    for i in once:
        lv = 0
        for a in _eqn_invars(eqns[i]):
            if a in made_by:
                p_level, p_stage = made_by[a]
                lv = max(lv, p_level + (p_stage != stage_of[i]))
        level[i] = lv
        for v in _eqn_outvars(eqns[i]):
            made_by[v] = (lv, stage_of[i])

    def outer_op(i: int, j: int | None) -> Op | None:
        """Equation ``i`` for microbatch ``j`` (None: once per step); a statistic's reader
        reads the whole batch's, and None where it only makes statistics."""
        e = eqns[i]
        outs = tuple(
            None if compat.is_dropvar(v) or (j is not None and v in stats.values) else okey(v, j)
            for v in e.outvars
        )
        ins = tuple(
            stats.values[a] if j is not None and _is_var(a) and a in stats.values else okey(a, j)
            for a in e.invars
        )
        return (
            Op(kind="eqn", eqn=e, ins=ins, outs=outs)
            if any(k is not None for k in outs) or not outs
            else None
        )

    pre_groups: dict[tuple[int, int], list[Op]] = {}
    post_groups: dict[tuple[int, int], list[Op]] = {}
    for where, specs in acc_specs.items():
        for _, ov in specs:
            start, finish = region_outputs.accumulator_ends(ov, nmb, joined.get(ov), gradient=ov in gradients)
            pre_groups.setdefault((0, where[0]), []).extend(start)
            post_groups.setdefault((0, where[0]), []).extend(finish)
    for ov, split in splits.items():
        post_groups.setdefault(made_by[ov], []).append(split.combine())
    for ov, key in whole_stats.items():
        post_groups.setdefault(made_by[ov], []).append(
            Op(kind="acc", mode="copy", ins=(key,), outs=((ov, None),))
        )
    for i in once:
        groups = pre_groups if region_at is None or i < region_at else post_groups
        op = at_whole.ops.get(i) if i in at_whole else outer_op(i, None)
        if op is not None:
            groups.setdefault((level[i], stage_of[i]), []).append(op)
    if at_whole.ops:
        group = {i: (level[i], stage_of[i]) for i in at_whole.after}
        for g, ops in whole_batch.input_ops(step, at_whole, group, per_mb, plan.num_stages - 1).items():
            post_groups[g] = ops + post_groups.get(g, [])
    if stats.ops:  # from the batch's microbatches alone, on the first stage that reads them
        readers = [(where[0], e) for where, ops in stage_ops.items() for e in ops]
        readers += [(stage_of[i], eqns[i]) for i in in_forward]
        first = min((st for st, e in readers if any(a in stats.values for a in _eqn_invars(e))), default=0)
        # After the once-per-step values they read (a state's running mean the batch's is added
        # to), which may be made on another stage.
        stats_made = {k for op in stats.ops for k in op.outs}
        lv = max(
            (
                made_by[k[0]][0] + (made_by[k[0]][1] != first)
                for op in stats.ops
                for k in op.ins
                if isinstance(k, tuple) and k[1] is None and k not in stats_made and k[0] in made_by
            ),
            default=0,
        )
        pre_groups.setdefault((lv, first), []).extend(stats.ops)
    for key, f in folded.items():  # on the key's first reader, once the key is made
        st = min(consumer_stages[key])
        made = made_by.get(key)
        lv = 0 if made is None else made[0] + (made[1] != st)
        pre_groups.setdefault((lv, st), []).append(microbatch_keys.fold_op(key, f, nmb))
    indexed = draws if draws is not None else early
    if indexed is not None and index_stages:
        pre_groups.setdefault((0, min(index_stages)), []).append(microbatch_draws.index_op(indexed, nmb))

    def once_tasks(phase: str, groups: dict[tuple[int, int], list[Op]]) -> list[Task]:
        return [
            Task(stage=st, label=f"{phase}{lv}", ops=ops, repeated=False)
            for (lv, st), ops in sorted(groups.items(), key=lambda kv: kv[0])
        ]

    tasks: list[Task] = once_tasks("pre", pre_groups)
    if region_at is not None:
        per_stage = schedule.make(plan.schedule, plan.num_stages, nmb)
        pipe: list[tuple[schedule.PipeTask, list[Op]]] = []
        for t in schedule.dispatch_order(per_stage):
            j, where = t.microbatch, (t.stage, t.pass_)
            ops = []
            if t.pass_ == "F":
                ops += [op for i in sorted(in_forward) if stage_of[i] == t.stage and (op := outer_op(i, j))]
            for e in stage_ops.get(where, []):
                outs = tuple(None if compat.is_dropvar(v) or v in stats.values else (v, j) for v in e.outvars)
                if any(k is not None for k in outs):
                    ops.append(Op(kind="eqn", eqn=e, ins=tuple(rkey(a, j) for a in e.invars), outs=outs))

            for (rv, *more), ov in acc_specs.get(where, []):
                keys = [rkey(v, j) for v in more]
                ops.append(region_outputs.accumulate(rkey(rv, j), ov, j, nmb, ov in joined, keys))
            if ops:
                pipe.append((t, ops))
        for label, st, ops, kept in _forward_backward_pairs(pipe):
            tasks.append(Task(stage=st, label=label, ops=ops, repeated=nmb > 1, kept=kept))
        tasks += once_tasks("post", post_groups)

    tasks = fuse_adjacent(tasks)
    output_keys = tuple(
        at_whole.keys[a]
        if _is_var(a) and a in at_whole.keys
        else okey(joined[a].var if _is_var(a) and a in joined else a, None)
        for a in jaxpr.outvars
    )
    return wire(tasks, output_keys, per_mb, microbatch_size)


def _forward_backward_pairs(
    pipe: list[tuple[schedule.PipeTask, list[Op]]],
) -> list[tuple[str, int, list[Op], tuple[Key, ...]]]:
    """``(label, stage, ops, kept)`` of the pipeline's tasks in dispatch order, where a microbatch's
    backward joins its forward when its stage runs nothing between the two and the backward
    reads nothing made in between (every microbatch of a one-stage plan, the last stage of
    1F1B).

    The joined task sits at the forward's place. Its residuals (what the forward keeps for the
    backward) stay inside one executable instead of being returned and passed back: for a
    model of many parameters that halves the arrays the driver passes per microbatch.
    ``kept``: those XLA stores (:func:`~autopar._src.fusion.split_residuals`).

    A backward that runs apart makes again the residuals XLA would recompute (cheap values its
    forward made from stored ones or from the forward's inputs), where no other task reads
    them: its forward then returns only the stored ones.
    """
    index = {(t.stage, t.microbatch, t.pass_): i for i, (t, _) in enumerate(pipe)}
    readers: dict[Key, set[int]] = {}
    for i, (_, ops) in enumerate(pipe):
        for op in ops:
            for k in op.ins:
                if isinstance(k, tuple):
                    readers.setdefault(k, set()).add(i)
    remade: dict[int, list[Op]] = {}
    joined: list[tuple[str, int, list[Op], tuple[Key, ...]]] = []
    taken: set[int] = set()
    for a, (t, ops) in enumerate(pipe):
        if a in taken:
            continue
        b = index.get((t.stage, t.microbatch, "B")) if t.pass_ == "F" else None
        if b is None:  # a backward (with what it remakes, found at its forward), or a lone forward
            joined.append((str(t), t.stage, remade.get(a, ops), ()))
            continue
        back = pipe[b][1]
        stored, recomputed = fusion.split_residuals(ops, back)
        nxt = next(i for i in range(a + 1, len(pipe)) if pipe[i][0].stage == t.stage)
        between = {k for _, o in pipe[a + 1 : nxt] for op in o for k in op.outs}
        if nxt == b and not between.intersection(k for op in back for k in op.ins if isinstance(k, tuple)):
            taken.add(b)
            joined.append((f"{t}+{pipe[b][0]}", t.stage, ops + back, stored))
            continue
        again = set(recomputed)
        copies = [op for op in ops if op.kind == "eqn" and again.intersection(op.outs)]
        if all(readers.get(k, set()) <= {a, b} for k in again) and all(
            k is None or k in again for op in copies for k in op.outs
        ):
            remade[b] = copies + back
        joined.append((str(t), t.stage, ops, ()))
    return joined
