"""Launch configs refuse warp counts Triton cannot launch."""

from __future__ import annotations

import pytest
from treeattn_lab.kernels.tuning import LaunchConfig, ScanConfig


@pytest.mark.parametrize("warps", [3, 6, 12])
def test_num_warps_must_be_a_power_of_two(warps):
    with pytest.raises(ValueError, match="launch config num_warps must be a power of two"):
        LaunchConfig(16, 16, warps, 1)
    with pytest.raises(ValueError, match="scan config num_warps must be a power of two"):
        ScanConfig(16, 16, warps, 1)


@pytest.mark.parametrize("warps", [1, 2, 4, 8, 16])
def test_power_of_two_warps_are_accepted(warps):
    assert LaunchConfig(16, 16, warps, 1).num_warps == warps
    assert ScanConfig(16, 16, warps, 1).num_warps == warps
