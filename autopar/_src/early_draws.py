"""Random draws in the batch's shape made before the loss function, equal to ``jax.jit``'s with
microbatches.

A diffusion step often draws its noise and noise levels before it takes the gradient
(``noise = jax.random.normal(key, x.shape)``, then ``value_and_grad`` of a loss reading it). The
code before the gradient that reads the batch runs per microbatch (:mod:`~autopar._src.partition`);
a draw there, traced at one microbatch, would draw the microbatch's shape from the whole step's
key: rows of no microbatch of ``jax.jit``'s draw. :func:`find` pairs the step's draws before the
loss function with those of the step traced at the whole batch, as
:func:`~autopar._src.microbatch_draws.find` does the loss function's; each such draw is made as
microbatch ``j``'s rows of the whole batch's, in the runs of the examples its values hold where
they meet the batch's in the loss function (:mod:`~autopar._src.draw_layout`). Its equation
reads the microbatch's index, and what it makes runs per microbatch with the batch. Where a
draw cannot be made so, the step is refused (:mod:`~autopar._src.microbatch_checks`), naming
the draw.
"""

from __future__ import annotations

from typing import Any

from autopar._src import draw_layout, example_order, microbatch_draws
from autopar._src.microbatch_draws import Draws
from autopar._src.trace import TracedStep


def find(step: TracedStep, whole: TracedStep, num_microbatches: int, index: Any = None) -> Draws | None:
    """The draws before ``step``'s loss function (traced at one microbatch) whose shape follows
    the batch in ``whole`` (at the whole batch), with places among the step's equations, if
    there are such draws and each can be made as ``jax.jit`` makes it; else None. ``index``: the
    microbatch's index to read (a new variable if None)."""
    at, at_whole = step.region_index(), whole.region_index()
    if at is None or at_whole is None:
        return None
    mine, theirs = step.jaxpr.eqns[:at], whole.jaxpr.eqns[:at_whole]
    if len(mine) != len(theirs):
        return None
    # Paired in the same places: the microbatch checks read their equations at those indices.
    scaled = microbatch_draws.scaled_draws(
        microbatch_draws.rng_eqns(mine), microbatch_draws.rng_eqns(theirs), num_microbatches, same_places=True
    )
    if not scaled:
        return None
    walk, _, twins = example_order.walked(step, whole, num_microbatches, run=True)
    pairs = {
        id(e): t for e, t in zip(step.jaxpr.eqns[: at + 1], whole.jaxpr.eqns[: at_whole + 1], strict=True)
    }
    region = draw_layout.Region(step.jaxpr.eqns[at], whole.jaxpr.eqns[at_whole], twins)
    return microbatch_draws.laid_out(
        scaled,
        lambda path: draw_layout.runs(
            step.jaxpr.eqns, lambda e: pairs.get(id(e)), path, walk, num_microbatches, region
        ),
        index,
    )
