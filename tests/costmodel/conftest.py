"""Fixtures of the cost-model tests."""

import pytest

from flashcp.costmodel.profile import HardwareProfile, load_profile


@pytest.fixture(scope="module")
def profile() -> HardwareProfile:
    """The default hardware profile."""
    return load_profile()
