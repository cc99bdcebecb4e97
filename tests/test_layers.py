"""Layer cuts, boundary markers and how they mirror into the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar._src import compat, layers, partition, trace


def _mlp_loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def _params(sizes, seed=0):
    rng = np.random.RandomState(seed)
    return [
        jnp.asarray(rng.randn(a, b).astype(np.float32)) for a, b in zip(sizes[:-1], sizes[1:], strict=False)
    ]


def _region(loss, args, num_layers):
    def step(*a):
        return trace.value_and_grad(loss)(*a)

    traced = trace.trace_step(step, args, trace.TraceOptions(num_layers=num_layers))
    region = traced.jaxpr.eqns[traced.region_index()]
    return traced, region.params["info"]


def test_boundaries_are_mirrored_in_the_backward():
    params = _params([8, 16, 16, 16, 4])
    _, info = _region(_mlp_loss, (params, jnp.ones((4, 8))), num_layers=4)
    marks = [(e.params["kind"], e.params["index"]) for e in info.jaxpr.eqns if layers.is_boundary(e)]
    assert marks == [
        ("fwd", 0),
        ("fwd", 1),
        ("fwd", 2),
        ("fwd", 3),
        ("bwd", 3),
        ("bwd", 2),
        ("bwd", 1),
        ("bwd", 0),
    ]


def test_cuts_balance_matmul_flops():
    # Four equal matmuls into two layers: two matmuls each.
    params = _params([32, 32, 32, 32, 32])
    _, info = _region(_mlp_loss, (params, jnp.ones((8, 32))), num_layers=2)
    assert info.layer_flops[0] == pytest.approx(info.layer_flops[1])
    assert sum(info.layer_flops) == pytest.approx(4 * 2 * 8 * 32 * 32)


def test_cut_goes_where_fewest_bytes_cross():
    # Between the two matmuls the activation is wide (256) then narrowed by a sum
    # over a reshape; the cut must be after the narrowing.
    def loss(ws, x):
        h = x @ ws[0]  # (8, 256)
        h = h.reshape(8, 16, 16).sum(-1)  # (8, 16): fewer bytes
        h = h @ ws[1]
        return jnp.mean(h)

    ws = [jnp.ones((4, 256)), jnp.ones((16, 2))]
    traced, info = _region(loss, (ws, jnp.ones((8, 4))), num_layers=2)
    flat = jax.make_jaxpr(lambda w, x: loss(w, x))(ws, jnp.ones((8, 4))).jaxpr
    (cut,) = info.cuts
    live = layers.live_across(flat, [cut])[0]
    assert sum(int(np.prod(v.aval.shape)) for v in live) == 8 * 16


def test_too_many_layers_is_a_clear_error():
    params = _params([8, 8, 8])
    with pytest.raises(ValueError, match="2 heavy operations .* but 3 layers"):
        _region(_mlp_loss, (params, jnp.ones((4, 8))), num_layers=3)


def test_nested_jit_and_custom_jvp_are_handled():
    # Hugging Face-style: each block under its own jit; relu/gelu are custom_jvp.
    @jax.jit
    def block(w, h):
        return jax.nn.gelu(jax.nn.relu(h @ w))

    def loss(ws, x):
        h = x
        for w in ws:
            h = block(w, h)
        return jnp.mean(h)

    ws = _params([8, 8, 8, 8])
    traced, info = _region(loss, (ws, jnp.ones((4, 8))), num_layers=3)
    assert len(info.cuts) == 2
    assert not any(compat.is_call(e) for e in traced.jaxpr.eqns)
    # Every layer's forward and backward lands on its own stage.
    placement = partition.region_eqn_placement(info.jaxpr, (0, 1, 2))
    assert {p for p in placement} == {(s, p) for s in range(3) for p in "FB"}


def test_value_and_grad_outside_autoparallel_is_jax():
    params = _params([8, 8, 2])
    x = jnp.ones((4, 8))
    ours = trace.value_and_grad(_mlp_loss)(params, x)
    ref = jax.value_and_grad(_mlp_loss)(params, x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), ours, ref))
    g_ours = trace.grad(_mlp_loss, argnums=(0, 1))(params, x)
    g_ref = jax.grad(_mlp_loss, argnums=(0, 1))(params, x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), g_ours, g_ref))
