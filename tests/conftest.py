import os
import sys

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
TEST_THREADS = 1
"""Torch threads per test process (and, through OMP_NUM_THREADS, per process a test starts: the
examples, the distributed workers). The tests' models are small: on a shared 2-core machine a
second thread made them many times slower, never faster. A test that needs more sets its own."""
torch.set_num_threads(TEST_THREADS)
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)

TEST_DEVICE = torch.device(os.environ.get("PSH_TEST_DEVICE", "cpu"))
"""Where the suite runs. ``PSH_TEST_DEVICE=cuda`` (or ``cuda:1``) makes it the default device
(``torch.set_default_device``): every model, input and ground-truth loop of every test is then
created there, float32 and float64 alike. Tests that cannot run there are skipped with their
reason (``CPU_ONLY``); random data comes from ``ground_truth.seeded`` generators, which follow
the default device. ``PSH_TEST_DEVICE=cpu`` sets the default device too, which runs the suite
under torch's device mode (a ``TorchFunctionMode``, stacked with the library's own) on a machine
without a GPU."""
if "PSH_TEST_DEVICE" in os.environ:
    if TEST_DEVICE.type not in ("cpu", "cuda") or (
            TEST_DEVICE.type == "cuda" and not torch.cuda.is_available()):
        raise RuntimeError(f"PSH_TEST_DEVICE={TEST_DEVICE}: only 'cpu' and an available 'cuda' "
                           "device are supported")
    torch.set_default_device(TEST_DEVICE)
    if TEST_DEVICE.type == "cuda":
        # float32 is IEEE float32 here: TF32 (10 bits of mantissa), cuDNN's default for float32
        # convolutions and RNNs, rounds their gradients ~1e-3, beyond the float32 tolerances
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

CPU_ONLY = {
    "test_distributed.py": "gloo processes on loopback, spawned without the default device",
    "test_fsdp.py": "FSDP2 over gloo processes on loopback, spawned without the default device",
    "test_examples.py": "the examples load their data on the CPU",
}
"""Test modules skipped on another device, with the reason."""


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE.type == "cpu":
        return
    import pytest
    for item in items:
        reason = CPU_ONLY.get(item.path.name)
        if reason is not None or item.get_closest_marker("cpu_only"):
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason or 'marked cpu_only'}"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): runs on the CPU only, skipped when "
                            "PSH_TEST_DEVICE names another device")

FUZZ_PROFILES = {"ci": 50, "long": 1000}
"""Examples per fuzz test (tests/test_fuzz.py) in each profile."""
_fuzz_common = dict(deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("psh-fuzz-ci", max_examples=FUZZ_PROFILES["ci"], derandomize=True,
                          **_fuzz_common)
settings.register_profile("psh-fuzz-long", max_examples=FUZZ_PROFILES["long"],
                          derandomize=False, **_fuzz_common)
_profile = os.environ.get("PSH_FUZZ_PROFILE", "ci")
if _profile not in FUZZ_PROFILES:
    raise ValueError(f"PSH_FUZZ_PROFILE must be one of {sorted(FUZZ_PROFILES)}, got {_profile!r}")
FUZZ_PROFILE = f"psh-fuzz-{_profile}"
"""The hypothesis profile test_fuzz.py uses (only it: other tests keep their own settings)."""
