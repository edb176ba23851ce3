"""Cluster fixtures shared by the tests (engine problems come from ``tests/engine/factory.build``),
and every test's time limit scaled by ``LAGOM_TEST_TIMEOUT_SCALE`` (``tests/timeouts.py``)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from tests.timeouts import SCALE, TEST_S


def pytest_collection_modifyitems(config, items):
    """Gives each test pytest-timeout's limit (its own ``timeout`` mark, else the ini's) times
    :data:`tests.timeouts.SCALE`, as the closest mark so that pytest-timeout reads it."""
    base_default = getattr(config, "_env_timeout", None) or TEST_S
    for item in items:
        mark = item.get_closest_marker("timeout")
        base = float(mark.args[0]) if mark is not None and mark.args else float(base_default)
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * SCALE), append=False)


@pytest.fixture(autouse=True)
def _release_run_folder_locks():
    """A run holds its folders' locks for its process's life (``training.preflight_files``); an
    in-process run of a test must not hold them into the next test."""
    from lagom_megatron.preflight.files import _HELD, release_folder_lock

    before = set(_HELD)
    yield
    for folder in set(_HELD) - before:
        release_folder_lock(folder)


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
