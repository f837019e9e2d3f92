"""`python -m megatron_hdp.megatron_lm SCRIPT [ARGS...]`: run a Megatron-LM script with HDP.

Runs an unmodified Megatron-LM training script (`pretrain_gpt.py`) as `__main__` after
replacing `megatron.training.pretrain` by `hdp_pretrain(pretrain)`, the wrapper the patch
installs; `--hdp` among ARGS then trains with HDP, without it the job is stock. Launch it
under torchrun (or SLURM) exactly as the script:

    torchrun --nproc-per-node 8 -m megatron_hdp.megatron_lm pretrain_gpt.py --hdp ...

The script's folder goes first on `sys.path`, as when Python runs the script itself.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    """Run the script named first in `argv` (default `sys.argv[1:]`) with HDP's hooks."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m megatron_hdp.megatron_lm SCRIPT.py [ARGS...]")
    script = argv[0]
    if not os.path.isfile(script):
        sys.exit(f"megatron_hdp.megatron_lm: {script}: no such file")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    install_pretrain()
    runpy.run_path(script, run_name="__main__")


def install_pretrain() -> None:
    """Put HDP's wrappers where training scripts import Megatron-LM's entry points from.

    `megatron.training.pretrain` becomes `hdp_pretrain(pretrain)`; where the script parses
    the arguments itself (core_v0.19.0: `arguments.parse_and_validate_args`), that function
    adds HDP's flags to its `extra_args_provider`.
    """
    import megatron.training
    from megatron.training import arguments, training

    from megatron_hdp.megatron_lm.hooks import hdp_pretrain, with_hdp_args

    wrapped = hdp_pretrain(training.pretrain)
    megatron.training.pretrain = wrapped
    training.pretrain = wrapped
    stock_parse = getattr(arguments, "parse_and_validate_args", None)
    if stock_parse is not None:

        def parse_and_validate_args(extra_args_provider=None, *args, **kwargs):
            return stock_parse(with_hdp_args(extra_args_provider), *args, **kwargs)

        arguments.parse_and_validate_args = parse_and_validate_args


if __name__ == "__main__":
    main()
