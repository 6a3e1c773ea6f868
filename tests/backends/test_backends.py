"""The backend registry: what ``auto`` picks on each device, and that it agrees with the
lowering's own default target (the two tables cannot drift apart)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fqr.backends import AUTO_BACKENDS, BACKENDS, auto_backend_name, resolve_backend
from fqr.lowering import default_target


@pytest.mark.parametrize("device_type", sorted(AUTO_BACKENDS))
def test_auto_runs_the_lowering_default_target_compiled(device_type):
    backend = BACKENDS[auto_backend_name(device_type)]
    # default_target reads only the device's type (an NPU device needs torch_npu to exist).
    assert backend.target == default_target(SimpleNamespace(type=device_type))
    assert backend.home_device == device_type and backend.device_types == (device_type,)


def test_auto_elsewhere_is_the_reference_never_an_interpreter():
    assert auto_backend_name("cpu") == auto_backend_name(torch.device("cpu")) == "reference"
    assert auto_backend_name("meta") == "reference"
    assert resolve_backend("auto", torch.device("cpu")) is BACKENDS["reference"]
