"""The plan: pure, JSON-serialisable data describing how a step is parallelised."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from autopar._src import records
from autopar._src.schedule import SCHEDULES, ScheduleName

DATA_AXIS = "data"
"""The mesh axis the batch is split over."""

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: which layers it runs and on which devices."""

    layers: tuple[int, int]
    """First layer of the stage and one past its last layer."""
    device_ids: tuple[int, ...]
    """Ids of the devices of the stage's submesh, in mesh order."""
    mesh_shape: tuple[int, ...]
    """Shape of the stage's logical mesh."""
    axis_names: tuple[str, ...]
    """Names of the stage's mesh axes (the batch is split over ``"data"``)."""
    forward_flops: float
    """FLOPs of the stage's forward per microbatch (heavy operations only)."""
    latency: float = 0.0
    """Predicted seconds of one microbatch's forward and backward (0: not predicted)."""
    memory_bytes: float = 0.0
    """Predicted peak bytes per device under the schedule (0: not predicted)."""
    compute_time: float = 0.0
    """Predicted seconds of computation in ``latency``."""
    source: tuple[str, str] = ("", "")
    """Source lines of the stage's first and last forward equations."""
    largest_params: tuple[str, ...] = ()
    """The stage's largest parameters: pytree path, shape and partition spec."""

    def label(self, index: int) -> str:
        """How errors name the stage, e.g. ``stage 1 (layers 4..7 on mesh {'data': 2, 'model': 4})``."""
        mesh = dict(zip(self.axis_names, self.mesh_shape, strict=True))
        return f"stage {index} (layers {self.layers[0]}..{self.layers[1] - 1} on mesh {mesh})"

    def __post_init__(self) -> None:
        start, stop = self.layers
        if not 0 <= start < stop:
            raise ValueError(
                f"StagePlan.layers must be (start, stop) with 0 <= start < stop, got {self.layers}"
            )
        if len(self.mesh_shape) != len(self.axis_names):
            raise ValueError(
                f"StagePlan.mesh_shape {self.mesh_shape} and axis_names {self.axis_names} differ in length"
            )
        size = 1
        for d in self.mesh_shape:
            size *= d
        if size != len(self.device_ids):
            raise ValueError(
                f"StagePlan.mesh_shape {self.mesh_shape} holds {size} devices but device_ids has "
                f"{len(self.device_ids)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """How a train step runs: layers, stages on submeshes, microbatches, schedule.

    Example:
      >>> plan = train_step.plan(state, batch)
      >>> print(plan)
    """

    num_microbatches: int
    """Microbatches each step's batch is split into."""
    schedule: ScheduleName
    """Pipeline schedule."""
    cuts: tuple[int, ...]
    """Forward cut positions (equation indices of the flattened loss)."""
    layer_flops: tuple[float, ...]
    """Forward FLOPs of each layer per microbatch."""
    stages: tuple[StagePlan, ...]
    """The pipeline stages, first to last."""
    predicted_step_time: float = 0.0
    """Predicted seconds per step (0: not predicted)."""
    memory_budget: float = 0.0
    """Bytes of memory per device the plan was made for (0: unknown)."""
    fingerprint: str = ""
    """Identifies the step's loss (operations and parameter shapes) the plan was made for."""
    version: int = PLAN_VERSION
    """Format version of the plan."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"Plan.num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if len(self.layer_flops) != len(self.cuts) + 1:
            raise ValueError(
                f"Plan has {len(self.cuts)} cuts but {len(self.layer_flops)} layer_flops; expected "
                f"{len(self.cuts) + 1}"
            )
        expected = 0
        for i, st in enumerate(self.stages):
            if st.layers[0] != expected:
                raise ValueError(f"Plan.stages[{i}].layers={st.layers} does not start at layer {expected}")
            expected = st.layers[1]
        if self.stages and expected != self.num_layers:
            raise ValueError(f"Plan.stages cover {expected} layers, the plan has {self.num_layers}")
        ids = [d for st in self.stages for d in st.device_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Plan.stages share devices: {ids}")

    @property
    def num_layers(self) -> int:
        """Number of forward layers."""
        return len(self.cuts) + 1

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    def layer_to_stage(self) -> tuple[int, ...]:
        """The stage of each layer."""
        return tuple(i for i, st in enumerate(self.stages) for _ in range(*st.layers))

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-compatible data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuilds a plan from :meth:`to_dict` output.

        Raises:
          ValueError: if the data has another format version or bad fields.
        """
        fields = records.fields_of(data, cls, "Plan data")
        version = fields.get("version")
        if version != PLAN_VERSION:
            raise ValueError(f"Plan format version {version!r} is not supported (expected {PLAN_VERSION})")
        if not isinstance(fields["stages"], list):
            raise ValueError(f"Plan data 'stages' must be a list, got {fields['stages']!r:.60}")
        stages = []
        for i, st in enumerate(fields.pop("stages")):
            what = f"Plan data stages[{i}]"
            st = records.fields_of(st, StagePlan, what)
            stages.append(records.build(StagePlan, what, **{k: _tuple(v) for k, v in st.items()}))
        rest = {k: _tuple(v) for k, v in fields.items()}
        return records.build(cls, "Plan data", **rest, stages=tuple(stages))

    def to_json(self) -> str:
        """The plan as a JSON string."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuilds a plan from :meth:`to_json` output.

        Raises:
          ValueError: if ``text`` is not JSON or not a plan.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a plan's JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        """Writes the plan as JSON to ``path``."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        """Reads a plan written by :meth:`save`.

        Raises:
          ValueError: naming ``path``, if it holds no plan.
        """
        return records.load_json(path, "plan", cls.from_dict)

    def timeline(self, path: str, **simulate_kwargs: Any) -> None:
        """Draws the schedule as a Gantt chart PNG (one row per stage) from predicted times.

        Measured times can be given as ``task_seconds={(stage, "F" | "B" | "F+B"): seconds}``
        (what :meth:`~autopar.AutoParallel.timed` returns).
        """
        from autopar._src import timeline

        timeline.plan_timeline(self, path, **simulate_kwargs)

    def __str__(self) -> str:
        from autopar._src import report

        return report.plan_table(self)


def _tuple(value: Any) -> Any:
    """JSON's lists as the tuples the dataclasses hold."""
    return tuple(value) if isinstance(value, list) else value
