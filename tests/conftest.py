import os
import sys

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))

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
