"""Test set-up: one thread per process, torch and Megatron imported once in the parent."""

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
