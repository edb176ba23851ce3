"""NCCL's network-selection, debugging and plugin variables and torch's TORCH_NCCL_* variables,
parsed with the grammar of the code that reads them (``nccl/env_check.py``)."""

import pytest

from lagom_megatron.nccl.env_network import check_network_env


@pytest.mark.parametrize(
    "env",
    [
        {"NCCL_SOCKET_IFNAME": "eth0"},
        {"NCCL_SOCKET_IFNAME": "^docker,lo"},
        {"NCCL_SOCKET_IFNAME": "=eth0"},
        {"NCCL_SOCKET_IFNAME": "^=docker0"},
        {"NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"},
        {"NCCL_IB_HCA": "=mlx5_0"},
        {"NCCL_DEBUG": "INFO"},
        {"NCCL_DEBUG": "warn"},
        {"NCCL_DEBUG_SUBSYS": "INIT,NET"},
        {"NCCL_DEBUG_SUBSYS": "^COLL"},
        {"NCCL_P2P_LEVEL": "NVL"},
        {"NCCL_SOCKET_FAMILY": "AF_INET6"},
        {"NCCL_IB_DISABLE": "1"},
        {"NCCL_NET_PLUGIN": "none"},
        {"TORCH_NCCL_BLOCKING_WAIT": "True"},
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
        {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"},
    ],
)
def test_values_the_readers_accept(env):
    assert check_network_env(env) == []


@pytest.mark.parametrize(
    "env, what",
    [
        ({"NCCL_SOCKET_IFNAME": "=^eth"}, "NCCL_SOCKET_IFNAME='=^eth' puts '=' before '^'; allowed order: ^ then ="),
        ({"NCCL_SOCKET_IFNAME": "^"}, "NCCL_SOCKET_IFNAME='^' names no interface"),
        (
            {"NCCL_SOCKET_IFNAME": "eth0, eth1"},
            "NCCL_SOCKET_IFNAME='eth0, eth1': entry ' eth1' is not an interface name",
        ),
        ({"NCCL_IB_HCA": "mlx5_0:one"}, "NCCL_IB_HCA='mlx5_0:one': port 'one' of 'mlx5_0' is not a number >= 1"),
        ({"NCCL_IB_HCA": "mlx5_0:0"}, "NCCL_IB_HCA='mlx5_0:0': port '0' of 'mlx5_0' is not a number >= 1"),
        ({"NCCL_DEBUG": "VERBOSE"}, "NCCL_DEBUG='VERBOSE' is not one of VERSION, WARN, INFO, ABORT, TRACE"),
        ({"NCCL_DEBUG_SUBSYS": "INIT,NETWORK"}, "NCCL_DEBUG_SUBSYS='INIT,NETWORK': unknown subsystem(s) 'NETWORK'"),
        ({"NCCL_P2P_LEVEL": "NVLINK"}, "NCCL_P2P_LEVEL='NVLINK' is not one of LOC, NVL, PIX, PXB, PHB, SYS"),
        ({"NCCL_SOCKET_FAMILY": "ipv6"}, "NCCL_SOCKET_FAMILY='ipv6' is not one of AF_INET, AF_INET6"),
        (
            {"NCCL_NET_PLUGIN": "/nonexistent/libnccl-net.so"},
            "NCCL_NET_PLUGIN='/nonexistent/libnccl-net.so': the file does not exist",
        ),
        ({"NCCL_IB_DISABLE": "yes"}, "NCCL_IB_DISABLE='yes' is not an integer"),
        ({"TORCH_NCCL_BLOCKING_WAIT": "on"}, "TORCH_NCCL_BLOCKING_WAIT='on' is not a boolean"),
        (
            {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "4"},
            "TORCH_NCCL_ASYNC_ERROR_HANDLING='4' is not an ErrorHandlingMode; allowed: 0, 1, 2, 3",
        ),
        ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "ten"}, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC='ten' is not an integer"),
    ],
)
def test_values_the_readers_refuse_or_ignore(env, what):
    (issue,) = check_network_env(env)
    assert issue.level == "error" and issue.what.startswith(what)
