"""window="auto" on a real device reads its numbers by device kind; the compile-only
devices of each target report the same kind as the hardware, so the manager's prediction
and ``overlap-ckpt aot``'s use the same figures."""

import pytest

from overlap_ckpt.costmodel.hardware import hardware_of

from .conftest import TPU_TARGET, target_or_skip


@pytest.mark.parametrize("name", ["h100", TPU_TARGET, "v6e:2x2"])
def test_a_targets_devices_map_to_its_own_numbers(name):
    target = target_or_skip(name)
    hardware = hardware_of(target.devices[0])
    assert hardware is not None, target.devices[0].device_kind
    assert (hardware.peak_flops, hardware.hbm_bytes_per_s, hardware.host_link_bytes_per_s) == (
        target.peak_flops, target.hbm_bytes_per_s, target.host_link_bytes_per_s)


def test_an_unknown_device_has_no_numbers():
    import jax

    assert hardware_of(jax.devices("cpu")[0]) is None
