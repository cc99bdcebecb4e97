"""A step that still carries the ``with_sharding_constraint`` calls of a hand-written pjit plan."""

import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, assert_same_as_jit
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar._src import trace
from autopar._src.user_constraints import first_constraint

D = 16
# The user's own mesh over all 8 devices, as a pjit plan has; a stage on 4 devices cannot run it.
MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def constrain(x, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(MESH, spec))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = constrain(nn.gelu(nn.Dense(4 * D)(x)), P("data", None, "model"))
        return x + nn.Dense(D)(h), None


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, flag):
        x = jax.jit(lambda y: constrain(y, P("data")))(nn.Dense(D)(x))  # in a nested jit
        x = nn.remat(Block)()(x, None)[0]  # in a rematerialised call
        x = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(x, None)[0]
        x = jax.lax.cond(flag, lambda y: constrain(jnp.tanh(y), P("data")), lambda y: y * 0.5, x)
        return nn.Dense(4)(x)


def _setup():
    net = Net()
    x = np.random.default_rng(0).normal(size=(8, 4, D)).astype(np.float32)
    params = net.init(jax.random.key(0), x, True)["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adamw(1e-2, eps=1e-5))

    def step(state, batch):
        def loss_fn(p):
            # One flag for the batch, repeated per example (not the first example's: by place).
            out = state.apply_fn({"params": p}, batch["x"], jnp.all(batch["flag"]))
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        # ... and in the update, where a pjit plan shards the optimizer's state.
        grads = jax.tree.map(lambda g: constrain(g, P()), grads)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(1)
    batches = [
        {
            "x": rng.normal(size=(8, 4, D)).astype(np.float32),
            "y": rng.normal(size=(8, 4, 4)).astype(np.float32),
            "flag": np.full((8,), flag),
        }
        for flag in (True, False, True)
    ]
    return step, state, batches


def test_the_steps_own_sharding_constraints_are_dropped_with_a_warning_and_it_runs_over_stages():
    step, state, batches = _setup()
    with pytest.warns(
        UserWarning, match=r"ignores the with_sharding_constraint at .*test_user_constraints\.py:"
    ):
        traced = trace.trace_step(step, (state, batches[0]), trace.TraceOptions(num_layers=None))
    assert first_constraint(traced.jaxpr) is None
    (region,) = trace.find_regions(traced.jaxpr)
    assert first_constraint(traced.jaxpr.eqns[region].params["info"].jaxpr) is None
    # Without dropping them the 4-device stages would be refused by XLA (two device sets).
    with pytest.warns(UserWarning, match="ignores the with_sharding_constraint"):
        assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=2)


def test_a_constraint_inside_a_custom_derivative_is_an_error_naming_its_line():
    @jax.custom_jvp
    def act(x):
        return jax.lax.with_sharding_constraint(jnp.tanh(x), NamedSharding(MESH, P("data")))

    act.defjvp(lambda p, t: (act(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))

    def step(w, batch):
        loss, g = autopar.value_and_grad(lambda w: jnp.mean(act(batch @ w) ** 2))(w)
        return w - 0.1 * g, loss

    lines, first = inspect.getsourcelines(act.__wrapped__)
    line = first + next(i for i, text in enumerate(lines) if "with_sharding_constraint" in text)
    with pytest.raises(
        ValueError, match=re.escape(f"test_user_constraints.py:{line}") + ".*remove the constraint"
    ):
        autopar.autoparallel(step, num_stages=1)(jnp.ones((D, D)), jnp.ones((8, D)))


RULES = (("batch", "data"), ("mlp", "model"), ("embed", None), ("length", None))


class LogicalBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(4 * D, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "length", "mlp"))
        return x + nn.Dense(D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)


class LogicalNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(LogicalBlock()(LogicalBlock()(x)))


def _regression(net, x_shape, seed):
    """``(step, state, batches)``: a mean-squared-error step of ``net`` and three batches."""
    rng = np.random.default_rng(seed)
    batches = [
        {
            "x": rng.normal(size=x_shape).astype(np.float32),
            "y": rng.normal(size=(*x_shape[:-1], 4)).astype(np.float32),
        }
        for _ in range(3)
    ]
    params = net.init(jax.random.key(0), batches[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adamw(1e-2, eps=1e-5))

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, state, batches


def test_a_step_called_under_the_users_mesh_and_logical_rules_runs_on_its_own_submeshes():
    step, state, batches = _regression(LogicalNet(), (8, 4, D), seed=2)
    boxed = jax.tree.leaves(state.params, is_leaf=lambda p: isinstance(p, nn.LogicallyPartitioned))
    assert any(isinstance(p, nn.LogicallyPartitioned) for p in boxed)

    # jax.jit constrains to the user's mesh; autopar's stages on devices 0-3 and 4-7 leave it.
    with jax.set_mesh(MESH), nn.logical_axis_rules(RULES):
        assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=2)
    assert jax.sharding.get_mesh().empty


def test_a_constraint_that_needs_the_users_mesh_while_traced_is_an_error_naming_the_fix():
    def step(w, batch):
        loss, g = autopar.value_and_grad(
            lambda w: jnp.mean(jax.lax.with_sharding_constraint(batch @ w, P("data")) ** 2)
        )(w)
        return w - 0.1 * g, loss

    with jax.set_mesh(MESH), pytest.raises(ValueError, match="jax.set_mesh.*NamedSharding"):
        autopar.autoparallel(step, num_stages=2)(jnp.ones((D, D)), jnp.ones((8, D)))
    assert jax.sharding.get_mesh().empty


def rms_norm(x):  # a kernel written per device, over the user's 8-device mesh
    def local(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    return jax.shard_map(local, mesh=MESH, in_specs=P(("data", "model")), out_specs=P(("data", "model")))(x)


class MappedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = rms_norm(nn.gelu(nn.Dense(D)(x)))
        return nn.Dense(4)(x)


def test_a_step_with_a_shard_map_runs_as_one_stage_on_its_mesh_and_other_plans_are_an_error():
    step, state, batches = _regression(MappedNet(), (16, D), seed=3)
    # One stage on the shard_map's 8 devices (the next test shows the search keeps to such plans).
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages="auto", num_microbatches=2)
    assert [st.device_ids for st in par.plan(state, batches[0]).stages] == [tuple(range(8))]
    for options in (dict(num_stages=2, num_microbatches=2), dict(num_stages=1, devices=jax.devices()[:4])):
        with pytest.raises(
            ValueError, match=r"shard_map at .*test_user_constraints\.py:\d+ \(rms_norm\).*num_stages=1"
        ):
            autopar.autoparallel(step, **options)(state, batches[0])


class WideMapped(nn.Module):
    mapped: bool

    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = nn.gelu(nn.Dense(2048)(x))
            x = rms_norm(x) if self.mapped else x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        return nn.Dense(4)(x)


@pytest.mark.parametrize("mapped", [False, True])
def test_the_stage_search_keeps_a_step_with_a_shard_map_to_one_stage_on_the_whole_cluster(mapped):
    net = WideMapped(mapped)
    x = jax.ShapeDtypeStruct((256, 2048), jnp.float32)

    def make_state():
        params = net.init(jax.random.key(0), jnp.zeros(x.shape))["params"]
        return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adamw(1e-2))

    def step(state, batch):
        loss, grads = autopar.value_and_grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    plan = autopar.plan_step(step, jax.eval_shape(make_state), x, cluster="2x8xV100", num_microbatches=8)
    # Over two hosts the same step with its norm written in jnp is pipelined.
    assert [len(st.device_ids) for st in plan.stages] == ([16] if mapped else [4, 4, 4, 4])
