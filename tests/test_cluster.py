"""Cluster specs: presets, validation, JSON, submesh and logical shapes."""

import dataclasses
import json

import pytest

from autopar._src import cluster
from autopar._src.cluster import ClusterSpec, DeviceSpec

PRESET_SPECS = [
    cluster.H100_SXM_8,
    cluster.H200_SXM_8,
    cluster.A100_SXM_8,
    cluster.V100_P3_16XLARGE,
    cluster.CPU_SIMULATED,
]


@pytest.mark.parametrize("spec", PRESET_SPECS, ids=lambda s: s.name)
def test_presets_are_valid_single_hosts_of_eight(spec):
    assert spec.num_hosts == 1 and spec.devices_per_host == 8 and spec.num_devices == 8
    for dtype in cluster.REQUIRED_DTYPES:
        assert spec.device.flops(dtype) > 0
    assert spec.inter_host_bandwidth <= spec.intra_host_bandwidth
    # Rebuilding through the validating constructor accepts the preset unchanged.
    assert dataclasses.replace(spec) == spec


def test_preset_figures():
    h100, a100, v100 = cluster.H100_SXM_8, cluster.A100_SXM_8, cluster.V100_P3_16XLARGE
    assert h100.device.flops("bfloat16") == 989e12 and h100.device.flops("float32") == 67e12
    assert h100.intra_host_bandwidth == 450e9 and h100.inter_host_bandwidth == 50e9
    assert a100.device.flops("float16") == 312e12 and a100.device.memory_bandwidth == 2.039e12
    assert a100.intra_host_bandwidth == 300e9 and a100.inter_host_bandwidth == 25e9
    assert v100.device.flops("float16") == 125e12 and v100.device.memory_bytes == 16 * 10**9
    assert v100.inter_host_bandwidth == pytest.approx(3.125e9 / 8)
    h200 = cluster.H200_SXM_8
    assert h200.device.flops("bfloat16") == 989e12 and h200.device.memory_bandwidth == 4.8e12
    assert h200.device.memory_bytes == 141 * 10**9 and h200.intra_host_bandwidth == 450e9


@pytest.mark.parametrize(
    ("platform", "kind", "name"),
    [
        ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
        ("gpu", "NVIDIA H200", "h200"),
        ("gpu", "NVIDIA A100-SXM4-80GB", "a100"),
        ("gpu", "Tesla V100-SXM2-16GB", "v100"),
        ("gpu", "NVIDIA L4", None),
        ("cpu", "cpu", "cpu"),
    ],
)
def test_preset_name_for_device_kind(platform, kind, name):
    device = type("Device", (), {"platform": platform, "device_kind": kind})()
    assert cluster.preset_name_for(device) == name


def test_preset_by_name_and_hosts():
    spec = cluster.preset("A100", num_hosts=4)
    assert spec.num_devices == 32 and spec.device == cluster.A100_SXM_8.device and spec.name == "4x8xA100"
    with pytest.raises(ValueError, match="tpu"):
        cluster.preset("tpu")
    with pytest.raises(ValueError, match="num_hosts"):
        cluster.preset("h100", num_hosts=0)


def test_flops_unknown_dtype():
    with pytest.raises(ValueError, match="int8"):
        cluster.H100_SXM_8.device.flops("int8")


def test_peak_flops_order_does_not_matter():
    flops = {"float32": 1.0, "bfloat16": 2.0, "float16": 3.0}
    a = DeviceSpec(name="d", peak_flops=tuple(flops.items()), memory_bandwidth=1.0, memory_bytes=1)
    b = DeviceSpec(name="d", peak_flops=tuple(reversed(flops.items())), memory_bandwidth=1.0, memory_bytes=1)
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hosts", 0),
        ("num_hosts", 1.5),
        ("devices_per_host", 0),
        ("intra_host_bandwidth", 0.0),
        ("inter_host_bandwidth", -1.0),
        ("inter_host_bandwidth", 1e15),  # faster than inside a host
        ("intra_host_latency", -1e-6),
        ("inter_host_latency", float("nan")),
        ("name", ""),
        ("device", "H100"),
    ],
)
def test_invalid_cluster_fields(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(cluster.H100_SXM_8, **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_bandwidth", 0.0),
        ("memory_bytes", 0),
        ("memory_bytes", 1.5e9),
        ("peak_flops", (("float32", 1e12), ("bfloat16", 1e12))),  # float16 missing
        ("peak_flops", (("float32", 1e12), ("bfloat16", -1.0), ("float16", 1e12))),
        ("peak_flops", "fast"),
    ],
)
def test_invalid_device_fields(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(cluster.H100_SXM_8.device, **{field: value})


@pytest.mark.parametrize("spec", [*PRESET_SPECS, cluster.parse_cluster("3x4xV100")], ids=lambda s: s.name)
def test_json_round_trip(spec, tmp_path):
    data = json.loads(json.dumps(spec.to_dict()))
    assert ClusterSpec.from_dict(data) == spec
    path = tmp_path / "cluster.json"
    spec.save(path)
    assert ClusterSpec.load(path) == spec


def test_from_dict_rejects_unknown_fields():
    data = cluster.H100_SXM_8.to_dict()
    data["nvlink_version"] = 4
    with pytest.raises(ValueError, match="nvlink_version"):
        ClusterSpec.from_dict(data)


def _without(data, *path):
    *inner, last = path
    for key in inner:
        data = data[key]
    del data[last]


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: "not json {", "is not a cluster spec JSON file"),
        (lambda d: [], "ClusterSpec data must be a JSON object, got list"),
        (lambda d: "hi", "ClusterSpec data must be a JSON object, got str"),
        (lambda d: {**d, "device": [1, 2]}, "'device' must be a JSON object"),
        (lambda d: {**d, "device": {**d["device"], "peak_flops": [1, 2]}}, "'peak_flops' must map dtypes"),
        (lambda d: _without(d, "device", "name") or d, r"'device' has no \['name'\]"),
        (lambda d: {**d, "intra_host_bandwidth": "fast"}, "intra_host_bandwidth must be a positive"),
    ],
)
def test_a_malformed_cluster_file_is_a_value_error_naming_it(tmp_path, edit, message):
    data = edit(cluster.H100_SXM_8.to_dict())
    path = tmp_path / "cluster.json"
    path.write_text(data if isinstance(data, str) and data.startswith("not") else json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}.*{message}"):
        ClusterSpec.load(path)


def test_submesh_shapes():
    assert cluster.submesh_shapes(cluster.preset("h100", 2)) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert cluster.submesh_shapes(cluster.H100_SXM_8) == ((1, 1), (1, 2), (1, 4), (1, 8))
    assert cluster.submesh_shapes(cluster.preset("cpu", 3, devices_per_host=6)) == (
        (1, 1),
        (1, 2),
        (1, 4),
        (1, 6),
        (2, 6),
        (3, 6),
    )


def test_logical_shapes():
    assert cluster.logical_shapes((1, 8)) == ((1, 8), (2, 4), (4, 2), (8, 1))
    assert cluster.logical_shapes((1, 1)) == ((1, 1),)
    assert cluster.logical_shapes((2, 3)) == ((1, 6), (2, 3), (3, 2), (6, 1))
    with pytest.raises(ValueError, match="submesh"):
        cluster.logical_shapes((0, 8))


def test_link_for():
    spec = cluster.preset("h100", 2)
    assert cluster.link_for(spec, (1, 8)) == (spec.intra_host_bandwidth, spec.intra_host_latency)
    link = cluster.link_for(spec, (2, 8))
    assert link.bandwidth == spec.inter_host_bandwidth and link.latency == spec.inter_host_latency
    with pytest.raises(ValueError, match="does not fit"):
        cluster.link_for(spec, (3, 8))


def test_axis_links_price_an_axis_within_a_host_while_it_fits():
    spec = cluster.preset("h100", 4)
    intra = (spec.intra_host_bandwidth, spec.intra_host_latency)
    inter = (spec.inter_host_bandwidth, spec.inter_host_latency)
    # The last axis is innermost: 8 devices fit one host, the outer axis spans all 32.
    assert cluster.axis_links(spec, (4, 8)) == (inter, intra)
    assert cluster.axis_links(spec, (8, 4)) == (inter, intra)
    assert cluster.axis_links(spec, (2, 16)) == (inter, inter)
    assert cluster.axis_links(spec, (2, 4)) == (intra, intra)
    assert cluster.axis_links(spec, (1,)) == (intra,)


@pytest.mark.parametrize(
    ("text", "hosts", "per_host", "device"),
    [
        ("2x8xV100", 2, 8, "V100-SXM2-16GB"),
        ("1x8xh100", 1, 8, "H100-SXM5-80GB"),
        (" 4 X 4 x A100 ", 4, 4, "A100-SXM4-80GB"),
    ],
)
def test_parse_cluster(text, hosts, per_host, device):
    spec = cluster.parse_cluster(text)
    assert (spec.num_hosts, spec.devices_per_host, spec.device.name) == (hosts, per_host, device)


@pytest.mark.parametrize("text", ["8xV100", "2x8xV100x1", "2x8xTPU", "axbxV100", "", "0x8xV100"])
def test_parse_cluster_rejects(text):
    with pytest.raises(ValueError, match="h100|num_hosts"):
        cluster.parse_cluster(text)
