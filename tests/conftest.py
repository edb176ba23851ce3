"""Cluster fixtures shared by the tests (engine problems come from ``tests/engine/factory.build``)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec


@pytest.fixture
def h100():
    return ClusterSpec.load("h100-sxm-ib400")


@pytest.fixture
def a100():
    return ClusterSpec.load("a100-ib100")


@pytest.fixture
def h200():
    return ClusterSpec.load("h200-sxm")


@pytest.fixture
def gloo():
    return ClusterSpec.load("cpu-gloo")
