"""Test set-up: one thread per process, torch and Megatron imported once in the parent.

Also the hypothesis profiles (`tests/property.py`): derandomized unless
`HDP_PROPERTY_PROFILE=long`, and every hypothesis test carries the `property` marker.
"""

import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

torch.set_num_threads(1)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: E402,F401  (imported here so forked ranks inherit it)
    import megatron.core.models.gpt  # noqa: E402,F401

import pytest  # noqa: E402

from tests.property import load_profile  # noqa: E402

load_profile()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark every hypothesis test `property` (before `-m` selects), even if it forgot to."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            if item.get_closest_marker("property") is None:
                item.add_marker(pytest.mark.property)
