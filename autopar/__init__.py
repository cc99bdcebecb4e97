"""autopar: automatic inter- and intra-operator parallelism for JAX train steps."""

from autopar._src.api import AutoParallel, Options, autoparallel, plan_step
from autopar._src.cluster import ClusterSpec, DeviceSpec, parse_cluster
from autopar._src.cluster import preset as cluster_preset
from autopar._src.compare import Comparison, Manual, compare, megatron_rules, rule_specs
from autopar._src.plan import Plan, StagePlan
from autopar._src.sharding_ilp import NoLayoutFitsError
from autopar._src.stage_problem import NoFeasiblePlanError
from autopar._src.trace import grad, value_and_grad

__all__ = [
    "AutoParallel",
    "ClusterSpec",
    "Comparison",
    "Manual",
    "DeviceSpec",
    "NoFeasiblePlanError",
    "NoLayoutFitsError",
    "Options",
    "Plan",
    "StagePlan",
    "autoparallel",
    "cluster_preset",
    "compare",
    "grad",
    "megatron_rules",
    "parse_cluster",
    "plan_step",
    "rule_specs",
    "value_and_grad",
]
__version__ = "0.1.0"
