"""Cluster files: the four shipped clusters load, bad files fail with clear messages."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec, available_clusters, parse_version


def test_shipped_clusters_load_with_expected_facts():
    assert {"h100-sxm-ib400", "a100-ib100", "h200-sxm", "cpu-gloo"} <= set(available_clusters())
    h100 = ClusterSpec.load("h100-sxm-ib400")
    a100 = ClusterSpec.load("a100-ib100")
    # 400 Gb/s per GPU is 50 GB/s; 100 Gb/s is 12.5 GB/s: the high- and low-bandwidth clusters.
    assert (h100.net_gbps_per_gpu, a100.net_gbps_per_gpu) == (400 / 8, 100 / 8)
    assert (h100.sms_per_gpu, h100.sm_arch, h100.nvswitch, h100.backend) == (132, 90, True, "nccl")
    assert ClusterSpec.load("cpu-gloo").backend == "gloo"
    assert ClusterSpec.load("h200-sxm").nccl >= (2, 30, 0)
    assert ClusterSpec.load(h100) is h100


def test_unknown_key_and_missing_file(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text((ClusterSpec.load("a100-ib100").to_dict() | {"hbm_gb": 1}).__repr__().replace("'", '"'))
    with pytest.raises(ValueError, match=r"unknown cluster key\(s\) \['hbm_gb'\]"):
        ClusterSpec.load(bad)
    with pytest.raises(FileNotFoundError, match="h100-sxm-ib400"):
        ClusterSpec.load("no-such-cluster")


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("sms_per_gpu", 0, "sms_per_gpu must be an integer >= 1"),
        ("hbm_gbps", -1, "hbm_gbps must be a number > 0"),
        ("nccl_version", "2.x", "nccl_version must look like"),
        ("backend", "mpi", "backend must be one of"),
    ],
)
def test_bad_values(key, value, fragment):
    data = ClusterSpec.load("h100-sxm-ib400").to_dict() | {key: value}
    with pytest.raises(ValueError, match=fragment):
        ClusterSpec.from_dict(data)


def test_parse_version():
    assert parse_version("2.27.5") == (2, 27, 5)
    assert parse_version("2.30") == (2, 30, 0)


def test_measured_bandwidth_fields_are_checked():
    from lagom_megatron.engine import cluster, knobs

    assert cluster.PROTOCOLS == knobs.PROTOCOLS  # the per-protocol keys are NCCL's protocol names
    base = ClusterSpec.load("a40-pcie-ib100").to_dict()
    spec = ClusterSpec.from_dict(
        base
        | {
            "per_channel_gbps": {"Simple": 5.5},
            "link_eff": {"LL": 0.4, "Simple": 0.85},
            "bw_saturation_p": 3.0,
            "channel_thread_exponent": 0.5,
        }
    )
    assert (spec.per_channel_gbps, spec.link_eff["LL"], spec.net_eff) == ({"Simple": 5.5}, 0.4, None)
    for bad, message in [
        ({"per_channel_gbps": {"Simpel": 5.0}}, "per_channel_gbps: unknown protocol 'Simpel'; allowed"),
        ({"link_eff": {"LL": 0}}, r"link_eff\['LL'\] must be a finite number > 0; got 0"),
        ({"net_eff": {"LL": float("nan")}}, r"net_eff\['LL'\] must be a finite number > 0"),
        ({"net_eff": 0.9}, "net_eff must map protocols"),
        ({"bw_saturation_p": 0.5}, "bw_saturation_p must be a number >= 1 or absent; got 0.5"),
        ({"channel_thread_exponent": -0.1}, "channel_thread_exponent must be a number >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ClusterSpec.from_dict(base | bad)


def test_an_empty_cluster_file_and_a_folder_named_like_a_cluster(tmp_path, monkeypatch):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(
        ValueError, match=f"^{empty}: a cluster file must be a mapping of keys to values; got an empty file$"
    ):
        ClusterSpec.load(empty)
    (tmp_path / "cpu-gloo").mkdir()  # a folder in the working directory does not hide the shipped cluster
    monkeypatch.chdir(tmp_path)
    assert ClusterSpec.load("cpu-gloo").backend == "gloo"
