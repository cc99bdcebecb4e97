"""num_stages="auto": clustering + stage DP on the real runtime; plans as data."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit
from flax.training import train_state

import autopar
from autopar._src import (
    autoplan,
    build,
    cluster,
    clustering,
    compat,
    cost,
    intra_op,
    layer_sharding,
    measure,
    measured,
    memory,
    profile,
    sharding_ilp,
    trace,
)
from models import train

BATCH = 16


def _cpu_cluster(mib: float) -> autopar.ClusterSpec:
    base = cluster.preset("cpu", devices_per_host=8)
    return dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=int(mib * 2**20)))


def _check_auto_plan(plan: autopar.Plan, num_devices: int = 8) -> None:
    assert sorted(d for st in plan.stages for d in st.device_ids) == list(range(num_devices))
    assert plan.predicted_step_time > 0
    assert all(0 < st.memory_bytes <= plan.memory_budget for st in plan.stages)


def test_auto_plan_and_microbatches_equal_jit():
    # Tiny GPT with two microbatches: test_auto_plan_runs_a_later_clustering_when_it_is_faster.
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages="auto", num_microbatches="auto"
    )
    _check_auto_plan(par.plan(state, batches[0]))


def test_auto_plan_keeps_the_fastest_automatic_clustering(monkeypatch):
    config = train.tiny_config("moe")
    step, state = train.setup("moe", "linen", config, OPTIMIZERS["adamw"]())
    batch = train.make_batch("moe", config, BATCH)
    spec = _cpu_cluster(2.0)
    each = {}  # layers -> predicted step of the plan of each factor on its own
    rules = [((f,), ()) for f in clustering.BYTES_FACTORS]
    rules += [((f,), (f,)) for f in clustering.UNBALANCED_FACTORS]  # with its balanced count
    for balanced, unbalanced in rules:
        monkeypatch.setattr(clustering, "BYTES_FACTORS", balanced)
        monkeypatch.setattr(clustering, "UNBALANCED_FACTORS", unbalanced)
        plan = autopar.plan_step(step, state, batch, cluster=spec)
        each[len(plan.cuts) + 1] = plan.predicted_step_time
    monkeypatch.undo()
    assert len(each) >= 2  # the factors cluster this model differently
    plan = autopar.plan_step(step, state, batch, cluster=spec)
    fastest = min(each, key=each.get)
    assert len(plan.cuts) + 1 == fastest and plan.predicted_step_time == each[fastest]


@pytest.mark.slow  # ~30 s: every automatic clustering is planned
def test_auto_plan_runs_a_later_clustering_when_it_is_faster(monkeypatch):
    # The finest clustering first: its 3 layers plan slower under the sharding ILP's costs than
    # the 2 of the second, so the plan and the step that runs come from the second trace.
    monkeypatch.setattr(clustering, "BYTES_FACTORS", (8.0, clustering.BYTES_FACTOR))
    monkeypatch.setattr(clustering, "UNBALANCED_FACTORS", ())
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    options = dict(num_stages="auto", num_microbatches=2, devices=jax.devices()[:4])
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], **options)
    plan = par.plan(state, batches[0])
    _check_auto_plan(plan, 4)
    monkeypatch.setattr(clustering, "BYTES_FACTORS", (8.0,))
    finest = autopar.autoparallel(step, **options).plan(state, batches[0])
    assert (len(finest.cuts), len(plan.cuts)) == (2, 1)
    assert plan.predicted_step_time < finest.predicted_step_time


# ~25 s with "data"; with the sharding ILP each of tiny GPT's three automatic clusterings is
# priced (~90 s).
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["data", "auto"])
def test_tight_memory_makes_a_plan_that_fits_and_equals_jit(sharding):
    config = train.tiny_config("gpt", num_layers=4)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    spec = _cpu_cluster(5.0)
    options = dict(num_stages="auto", num_microbatches=4, sharding=sharding)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], cluster=spec, **options)
    plan = par.plan(state, batches[0])
    # One data-parallel stage would need ~4.9 MiB per device, more than 5 MiB less the
    # memory model's 15% margin: the plan splits the layers over stages or, when tensors may
    # be split, the parameters over a model axis.
    split_tensors = any(
        dict(zip(st.axis_names, st.mesh_shape, strict=True)).get("model", 1) > 1 for st in plan.stages
    )
    assert plan.num_stages >= 2 or (sharding == "auto" and split_tensors)
    assert all(st.memory_bytes <= 0.85 * spec.device.memory_bytes for st in plan.stages)
    roomy = autopar.autoparallel(step, cluster=_cpu_cluster(64), **options).plan(state, batches[0])
    # More memory never makes the best plan slower; with data parallel stages only, the
    # roomy plan is one stage.
    assert roomy.predicted_step_time <= plan.predicted_step_time * (1 + 1e-9)
    if sharding == "data":
        assert roomy.num_stages == 1


def test_no_plan_fits_is_a_clear_error_before_any_work(monkeypatch):
    def unexpected(*args, **kwargs):
        raise AssertionError("the sharding ILP priced the layers of a step that no plan fits")

    # Memory does not depend on the latencies, so no clustering's layers reach the ILP.
    monkeypatch.setattr(layer_sharding, "layer_latency", unexpected)
    config = train.tiny_config("gpt", num_layers=4)
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, BATCH)
    par = autopar.autoparallel(step, num_stages="auto", num_microbatches=4, cluster=_cpu_cluster(0.3))
    with pytest.raises(
        autopar.NoFeasiblePlanError, match=r"largest layer, layer \d+, does not fit anywhere"
    ) as e:
        par(state, batch)
    message = str(e.value)
    assert "parameters/gradients/optimizer state/temporaries" in message
    assert "261.12 KiB" in message and "0.30 MiB less the memory model's 15% error margin" in message
    assert isinstance(e.value, ValueError)


def test_cluster_must_describe_the_devices():
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    spec = cluster.preset("cpu", devices_per_host=4)
    par = autopar.autoparallel(step, num_stages="auto", cluster=spec)
    with pytest.raises(ValueError, match="describes 4 devices but 8 devices were given"):
        par(state, train.make_batch("mlp", config, BATCH))


def test_auto_microbatches_needs_auto_stages():
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    par = autopar.autoparallel(step, num_stages=2, num_microbatches="auto")
    with pytest.raises(ValueError, match="num_microbatches='auto' needs num_stages='auto'"):
        par(state, train.make_batch("mlp", config, BATCH))


def test_plan_round_trips_and_is_reused(tmp_path):
    config = train.tiny_config("gpt", num_layers=4)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    plan = autopar.autoparallel(step, num_stages=4, num_microbatches=2).plan(state, batches[0])
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = autopar.Plan.load(str(path))
    assert loaded == plan
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], plan=loaded)
    # Another model does not match the plan's layers.
    other_step, other_state = train.setup(
        "gpt", "linen", train.tiny_config("gpt", num_layers=2), optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match="(?i)the plan does not match this step"):
        autopar.autoparallel(other_step, plan=loaded)(other_state, batches[0])
    # Nor do devices it was not made for.
    fewer = autopar.autoparallel(step, plan=loaded, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"device ids \[4, 5, 6, 7\] that are not among"):
        fewer(state, batches[0])
    # A plan for some of the devices runs on just those, when they are given.
    half = autopar.autoparallel(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:4])
    on_four = half.plan(state, batches[0])
    with pytest.raises(ValueError, match=r"uses 4 of the 8 devices .* leaving \[4, 5, 6, 7\] idle"):
        autopar.autoparallel(step, plan=on_four)(state, batches[0])
    # Options that a plan fixes cannot be given otherwise.
    for name, value in [("num_stages", 2), ("num_microbatches", 8), ("schedule", "gpipe")]:
        with pytest.raises(ValueError, match=f"{name}={value!r} conflicts with the plan given"):
            autopar.autoparallel(step, plan=loaded, **{name: value})
    autopar.autoparallel(step, plan=loaded, num_stages=4, num_microbatches=2, schedule="1f1b")
    odd = {k: v[:15] for k, v in batches[0].items()}
    with pytest.raises(ValueError, match="not divisible by the plan's num_microbatches=2; use a batch size"):
        autopar.autoparallel(step, plan=loaded)(state, odd)


@pytest.mark.parametrize(
    "hosts,per_host,sizes",
    [
        (1, 8, [(1, 4), (1, 2), (1, 2)]),
        (1, 8, [(1, 1), (1, 4), (1, 1), (1, 2)]),
        (3, 8, [(1, 4), (2, 8), (1, 4)]),
        (2, 4, [(1, 2), (1, 4), (1, 1), (1, 1)]),
    ],
)
def test_assign_devices_tiles_hosts(hosts, per_host, sizes):
    spec = cluster.preset("cpu", hosts, devices_per_host=per_host)
    placed = autoplan.assign_devices(sizes, spec)
    flat = [d for ids in placed for d in ids]
    assert sorted(flat) == list(range(hosts * per_host))
    for (h, w), ids in zip(sizes, placed, strict=True):
        assert len(ids) == h * w
        if h == 1:  # a slice of one host, aligned to its size
            assert len({i // per_host for i in ids}) == 1 and ids[0] % w == 0
        assert ids == list(range(ids[0], ids[0] + len(ids)))


def test_assign_devices_rejects_sizes_that_do_not_tile():
    spec = cluster.preset("cpu", devices_per_host=8)
    with pytest.raises(ValueError, match="do not tile"):
        autoplan.assign_devices([(1, 8), (1, 4)], spec)


def test_a_stage_without_a_fitting_layout_is_searched_again_with_less_memory(monkeypatch):
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    spec = _cpu_cluster(64)
    searched, failures = [], [sharding_ilp.NoLayoutFitsError("no fit", budget=3.0, least=4.0)] * 2
    search, solve = autoplan.auto_plan, intra_op.solve_stages
    no_plan_below = [0]

    def recording_search(*args, **kwargs):
        searched.append(kwargs["spec"].device.memory_bytes)
        if kwargs["spec"].device.memory_bytes < no_plan_below[0]:
            raise ValueError("no plan fits")
        return search(*args, **kwargs)

    def failing_solve(*args, **kwargs):
        if failures:
            raise failures.pop()
        return solve(*args, **kwargs)

    monkeypatch.setattr(autoplan, "auto_plan", recording_search)
    monkeypatch.setattr(intra_op, "solve_stages", failing_solve)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages="auto", cluster=spec)
    # Each search after a stage failed plans for budget / least (at most 0.9) of the memory;
    # the plan reports the device's.
    full = spec.device.memory_bytes
    assert searched == [full, int(full * 0.75), int(int(full * 0.75) * 0.75)]
    assert par.plan(state, batches[0]).memory_budget == full
    # With a fixed stage count, or a plan given, nothing is searched again: the stage's error
    # reaches the caller.
    fixed_plan = par.plan(state, batches[0])
    for options in (dict(num_stages=1), dict(plan=fixed_plan)):
        failures.append(sharding_ilp.NoLayoutFitsError("no fit", budget=3.0, least=4.0))
        with pytest.raises(sharding_ilp.NoLayoutFitsError, match="no fit"):
            autopar.autoparallel(step, cluster=spec, **options)(state, batches[0])
        assert not failures
    # After MEMORY_REPLANS more searches, or when the smaller device fits no plan, the
    # stage's error is raised (with the search's as its cause).
    failures.extend([sharding_ilp.NoLayoutFitsError("no fit", budget=3.0, least=4.0)] * 4)
    with pytest.raises(sharding_ilp.NoLayoutFitsError, match="no fit"):
        autopar.autoparallel(step, num_stages="auto", cluster=spec)(state, batches[0])
    assert not failures
    failures.append(sharding_ilp.NoLayoutFitsError("no fit", budget=3.0, least=4.0))
    no_plan_below[0] = full
    with pytest.raises(autopar.NoLayoutFitsError, match="no fit") as raised:
        autopar.autoparallel(step, num_stages="auto", cluster=spec)(state, batches[0])
    assert str(raised.value.__cause__) == "no plan fits"


def test_a_plan_whose_compiled_program_does_not_fit_is_searched_again(monkeypatch):
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    spec = _cpu_cluster(64)
    full = spec.device.memory_bytes
    searched, checked = [], []
    # The first plan's stage has no layout that fits; the second's program peaks 25% above
    # the device; the third fits.
    failures, overshoots = [sharding_ilp.NoLayoutFitsError("no fit", budget=3.0, least=4.0)], [1.25 * full]
    search, solve, compiled_peak = autoplan.auto_plan, intra_op.solve_stages, memory.compiled_peak

    def recording_search(*args, **kwargs):
        searched.append(kwargs["spec"].device.memory_bytes)
        return search(*args, **kwargs)

    def failing_solve(*args, **kwargs):
        if failures:
            raise failures.pop()
        return solve(*args, **kwargs)

    def peak(exe, stage):
        checked.append(len(searched))
        real = compiled_peak(exe, stage)
        return dataclasses.replace(real, peak=overshoots.pop()) if overshoots else real

    monkeypatch.setattr(autoplan, "auto_plan", recording_search)
    monkeypatch.setattr(intra_op, "solve_stages", failing_solve)
    monkeypatch.setattr(memory, "compiled_peak", peak)
    # A small plan on a roomy device is not checked, unless memory already proved tight.
    monkeypatch.setattr(build, "CHECK_FRACTION", float("inf"))
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages="auto", cluster=spec)
    # Each later search plans for budget / least, then device / peak, of the memory searched
    # last; the plan reports the device's.
    assert searched == [full, int(full * 0.75), int(int(full * 0.75) * 0.8)]
    assert set(checked) == {2, 3}
    assert par.plan(state, batches[0]).memory_budget == full


def test_plan_step_takes_the_decorated_step_and_a_cluster_string():
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, BATCH)
    plain = autopar.plan_step(step, state, batch, cluster=autopar.parse_cluster("1x8xV100"))
    decorated = autopar.plan_step(autopar.autoparallel(step), state, batch, cluster="1x8xV100")
    assert decorated.to_dict() == plain.to_dict()
    # Stages name the user's lines where they start and end, not Flax's or JAX's.
    sources = [line for st in plain.stages for line in st.source]
    assert sources and all("site-packages" not in line and "models/" in line for line in sources), sources
    with pytest.raises(ValueError, match="cluster must be an autopar.ClusterSpec or a string .*got 8"):
        autopar.plan_step(step, state, batch, cluster=8)


def test_auto_microbatches_go_beyond_64_only_where_no_fewer_fit():
    # Tiny GPT with a batch of 256 on 8 devices of 600 KiB: no count up to 64 fits, 256 of one
    # row each do. On 2 MiB, 32 and 64 fit (the costs choose between them) and the larger
    # counts are not searched.
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, 256)
    base = cluster.preset("cpu", devices_per_host=8)
    for kib, allowed in [(600, {256}), (2048, {32, 64})]:
        spec = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=kib * 1024))
        assert autopar.plan_step(step, state, batch, cluster=spec).num_microbatches in allowed
    spec = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=300 * 1024))
    with pytest.raises(autopar.NoFeasiblePlanError, match=r"more microbatches .*tried: \[1, 2, .*, 256\]"):
        autopar.plan_step(step, state, batch, cluster=spec)


def test_source_lines_are_the_users_not_a_librarys():
    dense = nn.Dense(4)
    x = jax.numpy.ones((2, 3))
    params = dense.init(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda p: dense.apply(p, x))(params).jaxpr  # the matmul is Flax's code
    line = compat.source_line(next(e for e in jaxpr.eqns if e.primitive.name == "dot_general"))
    assert "test_planning.py" in line and "site-packages" not in line, line


class _MLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def _distillation(teacher_inside: bool, encoder: bool = False):
    """A small student fitted to a frozen teacher 16 times its FLOPs, whose forward is made
    before ``autopar.value_and_grad`` or inside the loss function under ``stop_gradient``; with
    ``encoder``, the student reads the batch through a frozen linear encoder applied before it."""
    teacher, student = _MLP(256, 8), _MLP(64, 4)
    project = jnp.asarray(np.random.default_rng(1).normal(size=(64, 64)), jnp.float32)

    class State(train_state.TrainState):
        teacher: dict

    x = jnp.zeros((BATCH, 64))
    state = State.create(
        apply_fn=student.apply,
        params=student.init(jax.random.key(0), x)["params"],
        tx=optax.sgd(0.1),
        teacher=teacher.init(jax.random.key(1), x)["params"],
    )

    def step(state, batch):
        ahead = None if teacher_inside else teacher.apply({"params": state.teacher}, batch["x"])
        inputs = batch["x"] @ project if encoder else batch["x"]

        def loss_fn(p):
            target = (
                jax.lax.stop_gradient(teacher.apply({"params": state.teacher}, batch["x"]))
                if teacher_inside
                else ahead
            )
            logits = student.apply({"params": p}, inputs)
            return optax.kl_divergence(jax.nn.log_softmax(logits), jax.nn.softmax(target)).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    return step, state, [{"x": rng.normal(size=(BATCH, 64)).astype(np.float32)} for _ in range(2)]


def test_a_frozen_teachers_forward_before_the_loss_function_is_priced_on_the_stage_that_runs_it():
    """Made before the gradient from the batch, it runs per microbatch in the forward of the
    layer that reads the logits: the stage DP prices it there, as it prices the same forward made
    inside the loss function (once it was left out, and the step predicted twice as fast)."""
    plans = {}
    for inside in (True, False):
        step, state, batches = _distillation(inside)
        par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_microbatches=2)
        plans[inside] = par.plan(state, batches[0])
        _check_auto_plan(plans[inside])
    flops = {inside: sum(st.forward_flops for st in plan.stages) for inside, plan in plans.items()}
    np.testing.assert_allclose(flops[False], flops[True], rtol=0.02)
    np.testing.assert_allclose(plans[False].predicted_step_time, plans[True].predicted_step_time, rtol=0.1)
    step, state, batches = _distillation(teacher_inside=False, encoder=True)
    traced = autoplan.trace_at(
        step, (state, batches[0]), [len(jax.tree.leaves(state))], BATCH // 2, trace.TraceOptions(num_layers=3)
    )
    prof = profile.layer_profile(traced, (len(jax.tree.leaves(state)),))
    teacher = 2 * (BATCH // 2) * (64 * 256 + 7 * 256 * 256 + 256 * 10)
    encoder = 2 * (BATCH // 2) * 64 * 64
    # The first layer reads the encoded inputs, the loss's (the last) the teacher's logits.
    np.testing.assert_allclose(prof.before_flops, [encoder, 0, teacher])


def test_measured_layer_ranges_time_the_loss_functions_equations_alone(monkeypatch):
    """The code before the loss function is priced by its FLOPs (``before_flops``); the layer
    ranges the measured cost model times hold none of it (once the teacher's forward was timed
    with every range from layer 0, and counted twice)."""
    step, state, batches = _distillation(teacher_inside=False)
    ids = [len(jax.tree.leaves(state))]
    traced = autoplan.trace_at(step, (state, batches[0]), ids, BATCH // 2, trace.TraceOptions(num_layers=2))
    prof = profile.layer_profile(traced, tuple(ids))
    timed: dict[tuple[int, int], float] = {}
    real = measured._range_task

    def recording(tasks, all_ops, layer_of, start, stop):
        task = real(tasks, all_ops, layer_of, start, stop)
        timed[(start, stop)] = sum(cost.eqn_flops(op.eqn) for op in task.ops)
        return task

    monkeypatch.setattr(measured, "_range_task", recording)
    monkeypatch.setattr(measure, "measure", lambda fn, args, key, cache: 1e-3)
    measured.layer_range_latency(traced, ids, BATCH // 2, jax.devices()[:1], [1], cache=None)
    region = prof.forward_flops + prof.backward_flops - prof.before_flops
    assert prof.before_flops.sum() > 10 * region.sum()  # the teacher's forward
    np.testing.assert_allclose(
        [timed[(0, 1)], timed[(1, 2)], timed[(0, 2)]], [region[0], region[1], region.sum()]
    )


def test_the_peak_flops_follow_the_floating_work_not_a_dropout_masks_random_bits():
    """An ensemble drawing dropout inside its vmap spends most of its FLOPs on threefry's uint32
    rounds: the stage search prices it at the device's float32 peak (before, it asked the
    device for a uint32 peak it has none of)."""
    assert profile.compute_dtype({"uint32": 1e9, "float32": 1.0}) == "float32"
    assert profile.compute_dtype({"complex64": 5.0, "bfloat16": 1.0}) == "float32"
    assert profile.compute_dtype({"bfloat16": 5.0, "float32": 1.0, "uint32": 9.0}) == "bfloat16"
    assert profile.compute_dtype({"float8_e4m3fn": 10.0, "float32": 1.0}) == "float8_e4m3fn"
    assert profile.compute_dtype({"int8": 10.0, "bfloat16": 1.0}) == "int8"  # a quantized matmul
    assert profile.compute_dtype({}) == "float32"

    def loss_fn(p, x, y, key):
        def member(w1, w2, k):
            h = jnp.tanh(x @ w1)
            return (h * jax.random.bernoulli(k, 0.9, h.shape) / 0.9) @ w2

        out = jax.vmap(member)(p["w1"], p["w2"], jax.random.split(key, 3)).mean(0)
        return jnp.mean((out - y) ** 2)

    def step(state, batch):
        key, drawn = jax.random.split(state["key"])
        loss, grads = autopar.value_and_grad(loss_fn)(state["p"], batch["x"], batch["y"], drawn)
        return {"p": jax.tree.map(lambda a, g: a - 0.1 * g, state["p"], grads), "key": key}, loss

    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(3, 8, 16)) * 0.3, "w2": rng.normal(size=(3, 16, 4)) * 0.3}
    state = {"p": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p), "key": jax.random.key(0)}
    batches = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
        for _ in range(2)
    ]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages="auto", num_microbatches=1)
