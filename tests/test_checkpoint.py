"""Checkpoints of a pipelined step's state with Orbax: saved from the stages' devices, restored
straight onto them (``AutoParallel.input_shardings``), and training goes on as ``jax.jit``'s."""

import jax
import numpy as np
import orbax.checkpoint as ocp
from equality import OPTIMIZERS, TOLERANCES, as_numpy

import autopar
from models import train


def test_a_state_saved_with_orbax_resumes_on_the_stages_devices_and_equals_jit(tmp_path):
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("gpt", config, 8, seed=i) for i in range(4)]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2)
    saved = state
    for batch in batches[:2]:
        saved, _ = par(saved, batch)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step_2", saved)
    checkpointer.wait_until_finished()

    # A new run: the state's shapes only, and where the step takes each leaf.
    abstract = jax.eval_shape(lambda: state)
    shardings, batch_shardings = par.input_shardings(abstract, batches[0])
    assert all(s is None for s in jax.tree.leaves(batch_shardings, is_leaf=lambda x: x is None))
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    restored = checkpointer.restore(tmp_path / "step_2", target)
    placed = jax.tree.leaves(restored)
    for leaf, sharding, live in zip(placed, jax.tree.leaves(shardings), jax.tree.leaves(saved), strict=True):
        assert leaf.sharding == sharding == live.sharding  # where the step returned it
    assert len({frozenset(leaf.sharding.device_set) for leaf in placed}) == 2  # both stages' devices

    resumed, reference = restored, state
    for batch in batches[2:]:
        resumed, loss = par(resumed, batch)
    for batch in batches:
        reference, loss_ref = jax.jit(step)(reference, batch)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_ref), **TOLERANCES["adamw"])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])
