"""`python -m megatron_hdp.plot RUN_DIR [--step N]`: draw a run's pictures (see the package).

Exit statuses: 0 with the written paths on stdout; 2 with a one-line message when RUN_DIR
is not a run folder (or --step was not recorded); 1 when matplotlib is missing.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_hdp.plot import MatplotlibMissingError, RunDirError, draw_run


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, draw, and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_hdp.plot",
        description="Draw a training run's per-rank timeline and its loss and tokens/s curves "
        "as PNG files in RUN_DIR/pictures/.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds metrics.jsonl)")
    parser.add_argument(
        "--step", type=int, default=None, help="the recorded step to draw (default: the newest)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    try:
        written = draw_run(args.run_dir, step=args.step)
    except RunDirError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except MatplotlibMissingError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    for path in written:
        print(path)  # noqa: T201 - the command's output: the files it wrote
    return 0


if __name__ == "__main__":
    sys.exit(main())
