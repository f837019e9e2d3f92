"""Import a script of `scripts/` (not a package) as a module, for tests."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(relative_path: str, name: str):
    """The module at `REPO / relative_path`, imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
