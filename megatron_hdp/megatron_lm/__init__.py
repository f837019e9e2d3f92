"""HDP inside Megatron-LM's own training loop: `pretrain_gpt.py --hdp` (entry layer).

Two ways in, the same hooks (`hooks.py`):

- the patch `patches/core_v<tag>/pretrain_gpt.patch` (applied by
  `scripts/apply_megatron_patch.py`) wraps `pretrain` in `pretrain_gpt.py` with
  `hdp_pretrain`;
- the launcher `python -m megatron_hdp.megatron_lm pretrain_gpt.py --hdp ...` installs the
  same wrapper into an unmodified checkout at run time.

Without `--hdp` the job is stock Megatron-LM. Nothing here imports Megatron-LM's
`megatron.training` until the job calls it.
"""

from megatron_hdp.megatron_lm.hooks import hdp_pretrain, install_hooks, with_hdp_args

__all__ = ["hdp_pretrain", "install_hooks", "with_hdp_args"]
