"""Run a script as torchrun's worker and record its exit status (test only).

`python record_exit.py SCRIPT ARGS...` runs SCRIPT as `__main__` and writes the status it
exits with to `$HDP_TEST_EXIT_DIR/rank<RANK>` (nothing if the process is killed). Torchrun
reports no exit status of a worker it was told to stop: a signalled torchrun exits 1
whatever its workers did, so a test of the preemption path reads these files instead.
"""

import os
import runpy
import sys
from pathlib import Path


def _status(exit_code) -> int:
    if exit_code is None:
        return 0
    return exit_code if isinstance(exit_code, int) else 1


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    status = 1  # an exception other than SystemExit
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = _status(exit_.code)
        raise
    finally:
        out = Path(os.environ["HDP_TEST_EXIT_DIR"]) / f"rank{os.environ['RANK']}"
        out.write_text(f"{status}\n")


if __name__ == "__main__":  # not when a spawned helper imports this module as __mp_main__
    main()
