"""Test setup: 8 simulated CPU devices, set before JAX is imported."""

import os

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The tests check results, not how fast the compiled code runs: turning off the LLVM
# optimisations of XLA's CPU code takes about 30% off the suite, which is mostly compiling.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
