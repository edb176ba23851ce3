"""``validate_env``: the NCCL variables lagom writes (a plan's env, its exports) against NCCL's rules."""

from __future__ import annotations

import pytest

from lagom_megatron.nccl.env_vars import validate_env


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"NCCL_PROTO": "LL128"}, "LL128"),
        ({"NCCL_PROTO": "LL,LL128,Simple"}, "LL128"),
        ({"NCCL_ALGO": "NVLS"}, "Ring"),
        ({"NCCL_ALGO": "CollNetDirect,Tree"}, "Ring"),
        ({"NCCL_ALGO": "ring,foo"}, "'foo'"),
        ({"NCCL_NTHREADS": "480"}, "480"),
        ({"NCCL_BUFFSIZE": "1000000"}, "powers of two"),
    ],
)
def test_env_rules_reject(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        validate_env(env)


def test_env_rules_accept_exclusions_and_per_function_lists():
    validate_env(
        {
            "NCCL_PROTO": "^LL128",
            "NCCL_ALGO": "allreduce:nvls,ring;allgather:ring",
            "NCCL_NTHREADS": "256",
            "NCCL_BUFFSIZE": "4194304",
        }
    )
    validate_env({"NCCL_ALGO": "Ring,Tree"})
