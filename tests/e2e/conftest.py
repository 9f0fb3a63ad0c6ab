"""A local Ray instance shared by the end-to-end tests that start actors."""

import pytest


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
