"""autopar: automatic inter- and intra-operator parallelism for JAX train steps."""

from autopar._src.api import AutoParallel, Options, autoparallel
from autopar._src.plan import Plan, StagePlan
from autopar._src.trace import grad, value_and_grad

__all__ = ["AutoParallel", "Options", "Plan", "StagePlan", "autoparallel", "grad", "value_and_grad"]
__version__ = "0.1.0"
