"""Planning with measured stage costs, and the cache that spares re-profiling."""

import optax
from equality import TOLERANCES, assert_same_as_jit

import autopar
from autopar._src import measure
from models import train


def test_measured_plan_equals_jit_and_a_second_planning_run_hits_the_cache(tmp_path, monkeypatch):
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    batches = [train.make_batch("mlp", config, 16, seed=i) for i in range(3)]
    options = dict(num_stages="auto", num_microbatches=2, cost_model="measured", cost_cache=str(tmp_path))
    compiled: list[str] = []
    real_measure = measure.measure

    def counting(*args, **kwargs):
        compiled.append(kwargs["key"].digest())
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(measure, "measure", counting)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], **options)
    plan = par.plan(state, batches[0])
    assert plan.predicted_step_time > 0 and compiled
    entries = len(list(tmp_path.glob("*.json")))
    assert entries == len(compiled)
    # Planning again (a new wrapper, as in a new process) measures nothing.
    compiled.clear()
    again = autopar.autoparallel(step, **options).plan(state, batches[0])
    assert compiled == [] and again == plan
