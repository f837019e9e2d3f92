"""Test set-up: one thread per process, torch and Megatron imported once in the parent.

`tests/gpu` needs torch alone: `python -m pytest -m gpu tests/gpu` on a GPU machine.

Also the hypothesis profiles (`tests/property.py`): derandomized unless
`HDP_PROPERTY_PROFILE=long`, and every hypothesis test carries the `property` marker.
"""

import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

torch.set_num_threads(1)

# On a GPU machine with torch alone (tests/gpu), Megatron-Core and hypothesis may be absent;
# everywhere else they are installed, and the tests that need them import them.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import megatron.core  # noqa: F401  (imported here so forked ranks inherit it)
        import megatron.core.models.gpt  # noqa: F401
    except ImportError:
        pass

import pytest  # noqa: E402

try:
    from tests.property import load_profile
except ImportError:  # no hypothesis: only tests that do not use it can run
    pass
else:
    load_profile()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark every hypothesis test `property` (before `-m` selects), even if it forgot to."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            if item.get_closest_marker("property") is None:
                item.add_marker(pytest.mark.property)
