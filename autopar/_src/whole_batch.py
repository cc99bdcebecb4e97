"""Code outside the loss function that needs the whole batch: run once per step, at its shape.

With microbatches, the grad region runs once per microbatch, and so does what the step computes
from the batch before it to feed the loss (:mod:`~autopar._src.partition`). What the step computes
from the batch *after* the gradient (an accuracy from the returned logits and the labels, NNX's
``Accuracy``, the loss evaluated again by an optimizer's line search or a sharpness-aware step)
and what it returns from the batch computed before it (a token count) need the whole batch, as
``jax.jit`` computes them. Those equations run once per step, after the pipeline, as their twins
in the step traced at the whole batch: where the step's code does not change with the batch
size, the two traces have the same equations, differing in shapes alone. The twins read

- the batch's leaves, joined from the microbatches the forward tasks read (consecutive slices of
  the batch);
- the per-example region outputs (the logits), joined likewise
  (:class:`~autopar._src.region_outputs.Joined`);
- once-per-step values (the gradients, the loss, the parameters): the same variables as in the
  step traced at one microbatch.

Equations before the gradient that feed both the loss and such code run per microbatch for the
first, and once more at the whole batch for the second; so do the fills in the batch's shape they
read (the constant ``jnp.where`` broadcasts) and the figures of its size (a mean's ``1 / n``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

from autopar._src import compat, twin_traces
from autopar._src.program import Key, Op
from autopar._src.trace import TracedStep

if TYPE_CHECKING:  # for the annotation alone: no import cycle at run time
    from autopar._src.region_outputs import Joined


@dataclasses.dataclass(frozen=True)
class WholeBatchCode:
    """The equations of the step (by index) that run once per step at the whole batch."""

    after: frozenset[int]
    """Equations after the grad region that read the batch or a per-example region output."""
    again: tuple[int, ...]
    """Equations before the grad region, run again at the whole batch for the code after it or
    for the step's outputs."""
    before: frozenset[int]
    """Once-per-step equations before the grad region that the microbatches do not read, run
    as their twins in their place: those that differ at the whole batch (an examples-seen
    counter reading ``x.shape[0]``) and what reads them there."""
    ops: Mapping[int, Op]
    """Each equation's op: its twin at the whole batch, reading whole-batch keys. Empty when the
    program is built without the whole batch's trace (to time the pipeline's tasks alone)."""
    joins: Mapping[Any, Op]
    """Per batch leaf (its variable at one microbatch) the twins read: the op joining its
    microbatches."""
    keys: Mapping[Any, Key]
    """Each variable these equations make (at one microbatch) -> the key of its whole-batch
    value."""
    fills: tuple[int, ...] = ()
    """Once-per-step equations before the grad region that make a value in the batch's shape
    from no value of the batch (``jnp.where``'s broadcast constant), or from its size (the ``1 /
    n`` that ``jax.grad`` seeds a mean's backward with), that the equations above read: made
    again at the whole batch, beside the microbatches' own."""

    def __contains__(self, index: int) -> bool:
        return index in self.after or index in self.again or index in self.before


NONE = WholeBatchCode(frozenset(), (), frozenset(), {}, {}, {})


def _vars(atoms: Any) -> list[Any]:
    return [a for a in atoms if not compat.is_literal(a)]


def _vars_in(eqn: Any) -> list[Any]:
    return _vars(eqn.invars)


def _outs(eqn: Any) -> list[Any]:
    return [v for v in eqn.outvars if not compat.is_dropvar(v)]


def find(
    step: TracedStep,
    whole: TracedStep | None,
    per_microbatch: Set[Any],
    joined: Mapping[Any, Joined],
    nmb: int,
) -> WholeBatchCode:
    """The equations of ``step`` (traced at one of ``nmb`` microbatches) that need the whole
    batch, with their twins' ops in ``whole`` (the step traced at the whole batch; None: no ops).

    ``per_microbatch``: the batch's leaves and the values the step computes from them before the
    grad region; ``joined``: the region's per-example outputs.

    Raises:
      ValueError: if such an equation has no twin in ``whole`` (the step's code changes with the
        batch size), naming the equation and its source line.
    """
    at = step.region_index()
    assert at is not None, "code after the gradient needs a grad region"
    eqns = step.jaxpr.eqns
    twin_of = twins(step, whole) if whole is not None else None
    tainted = set(per_microbatch) | set(joined)
    # Once-per-step code before the region that differs at the whole batch (it reads the batch's
    # shape) and that code run per microbatch does not read (planning checks that), with what
    # reads it before the region: its twins run in its place.
    moved = set()
    if twin_of is not None:
        assert whole is not None
        per_mb = {i for i in range(at) if any(a in per_microbatch for a in _vars_in(eqns[i]))}
        feeds = feeding(step, set(range(at)), [at, *per_mb])
        for i in range(at):
            reads = _vars(eqns[i].invars)
            if i in feeds or i in per_mb:
                continue
            if str(eqns[i]) != str(whole.jaxpr.eqns[i]) or any(a in tainted for a in reads):
                moved.add(i)
                tainted.update(_outs(eqns[i]))
    after = set()
    for i in range(at + 1, len(eqns)):
        # Reading the batch, or its shape (``x.shape[0]``, Python's figure in the equation).
        shaped = whole is not None and twin_of is not None and str(eqns[i]) != str(whole.jaxpr.eqns[i])
        if shaped or any(a in tainted for a in _vars(eqns[i].invars)):
            after.add(i)
            tainted.update(_outs(eqns[i]))
    wanted = {a for i in after for a in _vars(eqns[i].invars) if a in per_microbatch}
    wanted |= {v for v in _vars(step.jaxpr.outvars) if v in per_microbatch}
    again = []
    for i in reversed(range(at)):
        if any(v in wanted for v in _outs(eqns[i])):
            again.append(i)
            wanted.update(a for a in _vars(eqns[i].invars) if a in per_microbatch)
    # Fills in the batch's shape the code above reads (the -100 that jnp.where broadcasts):
    # made again at the whole batch's shape too, beside the microbatches' own.
    fills = set()
    if twin_of is not None:
        assert whole is not None
        made_at = {v: i for i in range(at) for v in _outs(eqns[i])}
        # Once-per-step values that differ at the whole batch: in its shape, or made from its size.
        changed: set[Any] = set()
        for i in range(at):
            e, t = eqns[i], whole.jaxpr.eqns[i]
            if any(a in per_microbatch for a in _vars_in(e)):
                continue
            if (
                str(e) != str(t)
                or not all(_same_aval(v, w) for v, w in zip(e.outvars, t.outvars, strict=True))
                or any(a in changed for a in _vars(e.invars))
            ):
                changed.update(_outs(e))
        stack = [a for i in [*again, *after] for a in _vars(eqns[i].invars)]
        while stack:
            i = made_at.get(stack.pop(), -1)
            if i < 0 or i in fills or i in moved or i in again:
                continue
            if any(v in changed for v in _outs(eqns[i])):
                fills.add(i)
                stack.extend(_vars(eqns[i].invars))
    indices = sorted([*moved, *again, *after, *fills])
    if whole is None:
        return WholeBatchCode(frozenset(after), tuple(sorted(again)), frozenset(), {}, {}, {})
    if twin_of is None:
        theirs = whole.jaxpr.eqns[(whole.region_index() or 0) + 1 :]
        differs = [e for e, t in zip(eqns[at + 1 :], theirs, strict=False) if str(e) != str(t)]
        if indices or differs or len(theirs) != len(eqns) - at - 1:
            raise _no_twin(eqns[indices[0]] if indices else differs[0] if differs else eqns[-1], nmb)
    if not indices:
        return NONE
    assert twin_of is not None
    ops: dict[int, Op] = {}
    joins: dict[Any, Op] = {}
    keys: dict[Any, Key] = {}
    key_of: dict[Any, Key] = {}  # the whole trace's variables -> their keys

    def read(w: Any, e: Any) -> Any:
        if compat.is_literal(w):
            return w
        if w in key_of:
            return key_of[w]
        m = twin_of.get(w)
        if m is not None and m in joined:
            key_of[w] = (joined[m].var, None)
        elif m is not None and m in per_microbatch:  # a batch leaf (the rest are made again)
            join = joined_leaf(m, w, nmb)
            if join is None:
                raise _no_twin(e, nmb)
            joins[m] = join
            key_of[w] = join.out
        elif m is not None and _same_aval(m, w):
            key_of[w] = (m, None)
        else:
            raise _no_twin(e, nmb)
        return key_of[w]

    for i in indices:
        e, t = eqns[i], whole.jaxpr.eqns[i]
        ins = tuple(read(w, e) for w in t.invars)
        outs: list[Key | None] = []
        for v, w in zip(e.outvars, t.outvars, strict=True):
            if compat.is_dropvar(w):
                outs.append(None)
                continue
            # A value whose shape does not follow the batch keeps its name (the step's outputs
            # and their layouts are named by it); one that does is the whole trace's, as is a
            # fill's (its microbatch's is made too).
            key_of[w] = (v, None) if _same_aval(v, w) and i not in fills else (w, None)
            if i not in fills:
                keys[v] = key_of[w]
            outs.append(key_of[w])
        ops[i] = Op(kind="eqn", eqn=t, ins=ins, outs=tuple(outs))
    return WholeBatchCode(
        frozenset(after), tuple(sorted(again)), frozenset(moved), ops, joins, keys, tuple(sorted(fills))
    )


def feeding(step: TracedStep, before: set[int], readers: Sequence[int] = ()) -> set[int]:
    """The equations of ``before`` (before the grad region) whose values the region reads (or
    the equations ``readers``)."""
    eqns, at = step.jaxpr.eqns, step.region_index()
    assert at is not None, "code before a grad region"
    needed = {a for i in readers or [at] for a in _vars_in(eqns[i])}
    found = set()
    for i in sorted(before, reverse=True):
        if any(v in needed for v in _outs(eqns[i])):
            found.add(i)
            needed.update(_vars_in(eqns[i]))
    return found


def input_ops(
    step: TracedStep,
    at_whole: WholeBatchCode,
    group: dict[int, tuple[int, int]],
    per_mb: set[Any],
    last_stage: int,
) -> dict[tuple[int, int], list[Op]]:
    """The ops that make what the code after the region reads at the whole batch (the batch's
    leaves joined, the equations before the region made again), by the once-per-step group
    ``(level, stage)`` they run in: the first group that reads them (``group``: of the equations
    after the region), before its ops. Those only returned run beside the loss."""
    eqns = step.jaxpr.eqns
    first: dict[Any, tuple[int, int]] = {}  # microbatch values -> the first group reading them whole

    made_again = sorted([*at_whole.again, *at_whole.fills])
    fill_values = {v for i in at_whole.fills for v in _outs(eqns[i])}

    def note(i: int, g: tuple[int, int]) -> None:
        for a in _vars_in(eqns[i]):
            if a in per_mb or a in fill_values:
                first[a] = min(first.get(a, g), g)

    for i in sorted(group):
        note(i, group[i])
    for i in reversed(made_again):
        made = [first[v] for v in _outs(eqns[i]) if v in first]
        group[i] = min(made, default=(0, last_stage))
        note(i, group[i])
    ops: dict[tuple[int, int], list[Op]] = {}
    for m, join in at_whole.joins.items():
        ops.setdefault(first.get(m, (0, last_stage)), []).append(join)
    for i in made_again:
        ops.setdefault(group[i], []).append(at_whole.ops[i])
    return ops


def joined_leaf(m: Any, w: Any, nmb: int) -> Op | None:
    """The op joining the ``nmb`` microbatches of batch leaf ``m`` into ``w``, its variable at the
    whole batch (None where no one dim of ``w`` is ``nmb`` times ``m``'s)."""
    dims = twin_traces.per_example_dims(m, w, nmb)
    if len(dims) != 1:
        return None
    parts = tuple((m, j) for j in range(nmb))
    return Op(kind="acc", mode="concat", ins=parts, outs=((w, None),), axis=dims.pop())


def _same_aval(v: Any, w: Any) -> bool:
    a, b = v.aval, w.aval
    return bool(
        getattr(a, "shape", None) == getattr(b, "shape", None)
        and getattr(a, "dtype", None) == getattr(b, "dtype", None)
        and getattr(a, "weak_type", False) == getattr(b, "weak_type", False)
    )


def twins(step: TracedStep, whole: TracedStep) -> dict[Any, Any] | None:
    """The whole trace's variables -> their twins at one microbatch (arguments, constants and
    every equation's outputs), or None where the two traces' equations differ in more than
    their shapes."""
    mine, theirs = step.jaxpr, whole.jaxpr
    same = (
        len(mine.eqns) == len(theirs.eqns)
        and step.region_index() == whole.region_index()
        and len(step.arg_vars) == len(whole.arg_vars)
        and all(e.primitive is t.primitive for e, t in zip(mine.eqns, theirs.eqns, strict=True))
    )
    if not same:
        return None
    twin_of = dict(zip(whole.arg_vars, step.arg_vars, strict=True))
    if len(mine.constvars) == len(theirs.constvars):
        twin_of.update(zip(theirs.constvars, mine.constvars, strict=True))
    for e, t in zip(mine.eqns, theirs.eqns, strict=True):
        twin_of.update((w, v) for v, w in zip(e.outvars, t.outvars, strict=True) if not compat.is_dropvar(w))
    return twin_of


def _no_twin(eqn: Any, nmb: int) -> ValueError:
    return ValueError(
        f"The step computes {eqn.primitive.name} from the batch outside the loss function (at "
        f"{compat.source_line(eqn)}), for which autopar runs it once per step at the whole batch, "
        f"but the step's code there differs between the whole batch and one of num_microbatches={nmb} "
        "in more than shapes (it reads the batch's shape, or a value Python makes while tracing). "
        "Compute it inside the loss function and return it as aux (reduced over the batch, or per "
        "example), compute it outside the step, or use num_microbatches=1."
    )
