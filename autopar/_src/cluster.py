"""Devices, hosts and links: the hardware a plan is made for, and the submeshes it may use.

A cluster is ``num_hosts`` identical hosts of ``devices_per_host`` identical devices.
The inter-operator planner gives each pipeline stage a *submesh* ``(hosts, devices)``
and the intra-operator planner views it as a *logical* 2-D mesh ``(dp, tp)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, NamedTuple

from autopar._src import records

REQUIRED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator: compute, memory bandwidth and memory size."""

    name: str
    """Human-readable device name, e.g. ``"H100-SXM5-80GB"``."""
    peak_flops: tuple[tuple[str, float], ...]
    """Dense peak FLOP/s per dtype name, as ``(dtype, flops)`` pairs (kept sorted by dtype)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s."""
    memory_bytes: int
    """Device memory size in bytes."""
    kernel_time: float = 0.0
    """Seconds each kernel the device runs costs beyond its FLOPs and memory traffic (launch,
    ramp-up and tail of a small kernel); the cost model charges it per kernel per microbatch,
    so it is what makes smaller microbatches dearer. Datasheets give no such figure: the
    presets leave it at 0 and ``autopar calibrate`` measures it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceSpec.name must be a non-empty string, got {self.name!r}")
        try:
            pairs = tuple(sorted((str(k), float(v)) for k, v in dict(self.peak_flops).items()))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"DeviceSpec.peak_flops must be (dtype, flops) pairs, got {self.peak_flops!r}"
            ) from e
        if len(pairs) != len(self.peak_flops):
            raise ValueError(f"DeviceSpec.peak_flops names a dtype twice: {self.peak_flops}")
        # Sorted pairs make equality and hashing independent of the order they were given in.
        object.__setattr__(self, "peak_flops", pairs)
        missing = [d for d in REQUIRED_DTYPES if d not in dict(pairs)]
        if missing:
            raise ValueError(f"DeviceSpec.peak_flops lacks dtypes {missing}; it must give {REQUIRED_DTYPES}")
        for dtype, flops in pairs:
            if not (math.isfinite(flops) and flops > 0):
                raise ValueError(f"DeviceSpec.peak_flops[{dtype!r}] must be positive and finite, got {flops}")
        _check_positive("DeviceSpec.memory_bandwidth", self.memory_bandwidth)
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int):
            raise ValueError(f"DeviceSpec.memory_bytes must be an int, got {self.memory_bytes!r}")
        _check_positive("DeviceSpec.memory_bytes", self.memory_bytes)
        if not (_is_number(self.kernel_time) and self.kernel_time >= 0):
            raise ValueError(f"DeviceSpec.kernel_time must be a finite number >= 0, got {self.kernel_time!r}")

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (a dtype name such as ``"bfloat16"``).

        Raises:
          ValueError: if the device has no figure for ``dtype``.
        """
        table = dict(self.peak_flops)
        if dtype not in table:
            raise ValueError(
                f"DeviceSpec {self.name!r} has no peak FLOP/s for dtype {dtype!r}; known: {sorted(table)}"
            )
        return table[dtype]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Identical hosts of identical devices, with an alpha-beta model of their links."""

    name: str
    """Human-readable cluster name, e.g. ``"2x8xH100"``."""
    num_hosts: int
    """Number of hosts."""
    devices_per_host: int
    """Devices on each host."""
    device: DeviceSpec
    """The device every host holds."""
    intra_host_bandwidth: float
    """Bytes/s one device can send to another on the same host, one direction."""
    intra_host_latency: float
    """Seconds of fixed cost per message inside a host."""
    inter_host_bandwidth: float
    """Bytes/s one device can send to a device on another host, one direction."""
    inter_host_latency: float
    """Seconds of fixed cost per message between hosts."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ClusterSpec.name must be a non-empty string, got {self.name!r}")
        for field in ("num_hosts", "devices_per_host"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{field} must be an int >= 1, got {value!r}")
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"ClusterSpec.device must be a DeviceSpec, got {type(self.device).__name__}")
        _check_positive("ClusterSpec.intra_host_bandwidth", self.intra_host_bandwidth)
        _check_positive("ClusterSpec.inter_host_bandwidth", self.inter_host_bandwidth)
        for field in ("intra_host_latency", "inter_host_latency"):
            value = getattr(self, field)
            if not (_is_number(value) and value >= 0):
                raise ValueError(f"ClusterSpec.{field} must be a finite number >= 0, got {value!r}")
        if self.inter_host_bandwidth > self.intra_host_bandwidth:
            raise ValueError(
                f"ClusterSpec.inter_host_bandwidth={self.inter_host_bandwidth:g} exceeds "
                f"intra_host_bandwidth={self.intra_host_bandwidth:g}; links inside a host are assumed to be "
                "at least as fast as links between hosts (swapped values?)"
            )

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return self.num_hosts * self.devices_per_host

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-compatible data."""
        data = dataclasses.asdict(self)
        data["device"]["peak_flops"] = dict(self.device.peak_flops)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterSpec:
        """Rebuilds a spec from :meth:`to_dict` output.

        Raises:
          ValueError: on missing, unknown or invalid fields.
        """
        data = records.fields_of(data, cls, "ClusterSpec data", all_required=True)
        # A spec saved before a device field with a default existed still loads.
        device = records.fields_of(data["device"], DeviceSpec, "ClusterSpec data 'device'")
        if not isinstance(device["peak_flops"], dict):
            raise ValueError(
                "ClusterSpec data 'device' 'peak_flops' must map dtypes to FLOP/s, got "
                f"{device['peak_flops']!r:.60}"
            )
        device["peak_flops"] = tuple(device["peak_flops"].items())
        spec = records.build(DeviceSpec, "ClusterSpec data 'device'", **device)
        return records.build(cls, "ClusterSpec data", **{**data, "device": spec})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the spec to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Reads a spec written by :meth:`save`.

        Raises:
          ValueError: naming ``path``, if it holds no cluster spec.
        """
        return records.load_json(path, "cluster spec", cls.from_dict)


class Link(NamedTuple):
    """Alpha-beta parameters of the links a submesh's collectives use."""

    bandwidth: float
    """Bytes/s per device, one direction."""
    latency: float
    """Seconds of fixed cost per message."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive(field: str, value: float) -> None:
    if not (_is_number(value) and value > 0):
        raise ValueError(f"{field} must be a positive finite number, got {value!r}")


# Presets. Figures are dense (no structured sparsity) peaks from vendor datasheets; the
# latencies are typical orders of magnitude, not published figures, and matter only for
# small messages.

_H100_SXM = DeviceSpec(
    name="H100-SXM5-80GB",
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16/FP16 tensor core; 67 TFLOP/s FP32 is the
    # non-tensor-core figure (XLA's default float32 matmul precision may use TF32 and run faster).
    peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12)),
    memory_bandwidth=3.35e12,  # NVIDIA H100 SXM datasheet: HBM3, 3.35 TB/s.
    memory_bytes=80 * 10**9,  # NVIDIA H100 SXM datasheet: 80 GB.
)

H100_SXM_8 = ClusterSpec(
    name="1x8xH100",
    num_hosts=1,
    devices_per_host=8,
    device=_H100_SXM,
    # NVIDIA H100 SXM datasheet: NVLink 4 at 900 GB/s bidirectional, i.e. 450 GB/s each way.
    intra_host_bandwidth=450e9,
    intra_host_latency=5e-6,
    # DGX H100 user guide: one 400 Gb/s NDR InfiniBand adapter per GPU, i.e. 50 GB/s.
    inter_host_bandwidth=50e9,
    inter_host_latency=10e-6,
)

_H200_SXM = DeviceSpec(
    name="H200-SXM-141GB",
    # NVIDIA H200 datasheet: the H100's tensor cores (989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32)
    # with 141 GB of HBM3e at 4.8 TB/s.
    peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12)),
    memory_bandwidth=4.8e12,
    memory_bytes=141 * 10**9,
)

H200_SXM_8 = dataclasses.replace(H100_SXM_8, name="1x8xH200", device=_H200_SXM)
"""An HGX H200 host: the H100 host's NVLink 4 and one 400 Gb/s adapter per GPU, H200 devices."""

_A100_SXM = DeviceSpec(
    name="A100-SXM4-80GB",
    # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 tensor core; 19.5 TFLOP/s FP32 (non-tensor-core).
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
    memory_bandwidth=2.039e12,  # NVIDIA A100 80GB SXM datasheet: HBM2e, 2,039 GB/s.
    memory_bytes=80 * 10**9,
)

A100_SXM_8 = ClusterSpec(
    name="1x8xA100",
    num_hosts=1,
    devices_per_host=8,
    device=_A100_SXM,
    # NVIDIA A100 datasheet: NVLink 3 at 600 GB/s bidirectional, i.e. 300 GB/s each way.
    intra_host_bandwidth=300e9,
    intra_host_latency=5e-6,
    # DGX A100 user guide: one 200 Gb/s HDR InfiniBand adapter per GPU, i.e. 25 GB/s.
    inter_host_bandwidth=25e9,
    inter_host_latency=10e-6,
)

_V100_SXM2 = DeviceSpec(
    name="V100-SXM2-16GB",
    # NVIDIA V100 datasheet: 125 TFLOP/s FP16 tensor core, 15.7 TFLOP/s FP32. V100 has no bfloat16
    # arithmetic, so bfloat16 runs at the float32 rate.
    peak_flops=(("bfloat16", 15.7e12), ("float16", 125e12), ("float32", 15.7e12)),
    memory_bandwidth=900e9,  # NVIDIA V100 datasheet: HBM2, 900 GB/s.
    memory_bytes=16 * 10**9,
)

V100_P3_16XLARGE = ClusterSpec(
    name="1x8xV100",
    num_hosts=1,
    devices_per_host=8,
    device=_V100_SXM2,
    # NVIDIA V100 datasheet: NVLink 2 at 300 GB/s aggregate (six links, 25 GB/s each way each), i.e.
    # 150 GB/s each way per GPU. In the p3.16xlarge hybrid cube-mesh not every pair of GPUs shares a
    # link, so this is what a ring collective driving all six links reaches, not a pairwise figure;
    # it is the right figure for collectives, optimistic for single point-to-point copies.
    intra_host_bandwidth=150e9,
    intra_host_latency=10e-6,
    # AWS EC2 instance types page: p3.16xlarge has 25 Gbit/s networking per instance (3.125 GB/s),
    # shared by its 8 GPUs.
    inter_host_bandwidth=3.125e9 / 8,
    inter_host_latency=50e-6,
)

CPU_SIMULATED = ClusterSpec(
    name="1x8xCPU",
    num_hosts=1,
    devices_per_host=8,
    # XLA's simulated CPU devices sharing one 2-core machine, per device while all eight work
    # at once, as `autopar calibrate` measured them (float32 matmuls 20.9 GFLOP/s, half precision
    # ~18.5 (emulated), streaming 5.1 GB/s, all-reduce ring steps of 33 us at 605 MB/s);
    # calibrating another machine replaces them.
    device=DeviceSpec(
        name="CPU-simulated",
        peak_flops=(("bfloat16", 18e9), ("float16", 18e9), ("float32", 20e9)),
        memory_bandwidth=5e9,
        memory_bytes=2 * 2**30,
    ),
    intra_host_bandwidth=0.6e9,
    intra_host_latency=33e-6,
    # Several local processes stand in for hosts; a cross-process transfer was measured at about
    # 1.7 ms per MiB (roughly 0.6 GB/s), plus a millisecond-scale setup.
    inter_host_bandwidth=0.5e9,
    inter_host_latency=1e-3,
)

PRESETS: dict[str, ClusterSpec] = {
    "h100": H100_SXM_8,
    "h200": H200_SXM_8,
    "a100": A100_SXM_8,
    "v100": V100_P3_16XLARGE,
    "cpu": CPU_SIMULATED,
}


def preset(name: str, num_hosts: int = 1, *, devices_per_host: int | None = None) -> ClusterSpec:
    """A preset cluster (``"h100"``, ``"h200"``, ``"a100"``, ``"v100"``, ``"cpu"``) with ``num_hosts`` hosts.

    Example:
      >>> preset("a100", num_hosts=2).num_devices
      16

    Raises:
      ValueError: on an unknown name or a bad host or device count.
    """
    base = PRESETS.get(name.lower())
    if base is None:
        raise ValueError(f"Unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}")
    per_host = base.devices_per_host if devices_per_host is None else devices_per_host
    kind = base.name.rsplit("x", 1)[-1]
    return dataclasses.replace(
        base, name=f"{num_hosts}x{per_host}x{kind}", num_hosts=num_hosts, devices_per_host=per_host
    )


def preset_name_for(device: Any) -> str | None:
    """The preset whose name the device's kind contains (``"NVIDIA H200"`` -> ``"h200"``),
    ``"cpu"`` on the CPU platform, else ``None``."""
    if device.platform == "cpu":
        return "cpu"
    kind = str(device.device_kind).lower()
    return next((name for name in PRESETS if name != "cpu" and name in kind), None)


_CLUSTER_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*([A-Za-z0-9]+)\s*$")


def parse_cluster(text: str) -> ClusterSpec:
    """Parses ``"HOSTSxDEVICESxNAME"``, e.g. ``"2x8xV100"``, into a preset-based spec.

    Raises:
      ValueError: if the text does not have that form or names an unknown device.
    """
    match = _CLUSTER_RE.match(text)
    if match is None:
        raise ValueError(
            f"Cannot parse cluster {text!r}: expected HOSTSxDEVICESxNAME such as '2x8xV100', with NAME one "
            f"of {sorted(PRESETS)}"
        )
    hosts, per_host, name = int(match[1]), int(match[2]), match[3]
    if name.lower() not in PRESETS:
        raise ValueError(
            f"Cannot parse cluster {text!r}: unknown device {name!r}; choose one of {sorted(PRESETS)}"
        )
    return preset(name, hosts, devices_per_host=per_host)


def submesh_shapes(spec: ClusterSpec) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes ``(hosts, devices)``: power-of-two slices of one host, then whole hosts.

    These shapes can always tile the cluster when their device counts add up to it
    (Alpa, Theorem 1), so the stage search only has to match the total.
    """
    shapes = set()
    width = 1
    while width <= spec.devices_per_host:
        shapes.add((1, width))
        width *= 2
    for hosts in range(1, spec.num_hosts + 1):
        shapes.add((hosts, spec.devices_per_host))
    return tuple(sorted(shapes, key=lambda s: (s[0] * s[1], s)))


def logical_shapes(submesh: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Every logical 2-D mesh ``(dp, tp)`` with ``dp * tp`` equal to the submesh's device count."""
    hosts, devices = submesh
    if hosts < 1 or devices < 1:
        raise ValueError(f"submesh must be (hosts, devices) with both >= 1, got {submesh}")
    n = hosts * devices
    return tuple((dp, n // dp) for dp in range(1, n + 1) if n % dp == 0)


def link_for(spec: ClusterSpec, submesh: tuple[int, int]) -> Link:
    """The link parameters of collectives on ``submesh``: inter-host ones once it spans hosts.

    Raises:
      ValueError: if the submesh does not fit in the cluster.
    """
    hosts, devices = submesh
    if not (1 <= hosts <= spec.num_hosts and 1 <= devices <= spec.devices_per_host):
        raise ValueError(
            f"submesh {submesh} does not fit cluster {spec.name!r} of {spec.num_hosts} host(s) x "
            f"{spec.devices_per_host} devices"
        )
    if hosts > 1:
        return Link(bandwidth=spec.inter_host_bandwidth, latency=spec.inter_host_latency)
    return Link(bandwidth=spec.intra_host_bandwidth, latency=spec.intra_host_latency)


def axis_links(spec: ClusterSpec, shape: tuple[int, ...]) -> tuple[Link, ...]:
    """The link each axis of a logical mesh of ``shape`` is priced by.

    Devices are laid out in mesh order, the last axis fastest, so an axis of size ``s`` whose
    inner axes hold ``k`` devices spans ``s * k`` consecutive devices: within one host while
    that fits, else across hosts.
    """
    per_host = spec.devices_per_host
    links = []
    for i, size in enumerate(shape):
        span = size * math.prod(shape[i + 1 :])
        links.append(
            link_for(spec, (1, span) if span <= per_host else (math.ceil(span / per_host), per_host))
        )
    return tuple(links)
