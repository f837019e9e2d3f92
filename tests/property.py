"""Hypothesis profiles for the property tests (`@pytest.mark.property`).

- `default`: what the suite and CI run. Derandomized (a fixed seed per test), no example
  database, no deadline: the same examples on every run and every machine, so CI never
  passes or fails by chance.
- `long`: random (a fresh seed each run) and `LONG_SCALE` times the examples. Run it with
  `bash scripts/property_tests.sh` (which sets `HDP_PROPERTY_PROFILE=long`) before an
  issue touching the planner is resolved. A failure prints the falsifying example and a
  `@reproduce_failure` blob to replay it.

Select one with `HDP_PROPERTY_PROFILE=<name>` or pytest's `--hypothesis-profile=<name>`;
`HDP_PROPERTY_SCALE=<n>` overrides the example scale. Tests set their example counts with
`examples(n)`, since a count in `@settings` overrides the profile's.
"""

import os

from hypothesis import settings

PROFILE_ENV = "HDP_PROPERTY_PROFILE"
SCALE_ENV = "HDP_PROPERTY_SCALE"
LONG_SCALE = 50

settings.register_profile("default", derandomize=True, database=None, deadline=None)
settings.register_profile("long", derandomize=False, database=None, deadline=None, print_blob=True)


def load_profile() -> None:
    """Load the profile named by `HDP_PROPERTY_PROFILE` (`default` when unset)."""
    settings.load_profile(os.environ.get(PROFILE_ENV) or "default")


def examples(n: int) -> int:
    """`n` examples in the default profile, `LONG_SCALE * n` in the long one."""
    scale = os.environ.get(SCALE_ENV)
    if scale:
        return max(1, round(n * float(scale)))
    return n * (LONG_SCALE if settings.get_current_profile_name() == "long" else 1)
