"""Run Megatron-LM's real `pretrain_gpt.py` on forked CPU ranks and record what it logged.

The Megatron-LM training trees in `../shared/third_party/` are copied to a temporary folder
(one stock copy, one with `patches/<tag>/` applied by `scripts/apply_megatron_patch.py`);
the patched copy goes first on `sys.path` of this (parent) process, which imports
`megatron.training` once, so that forked ranks inherit it. Each rank runs the script as
`__main__` (or through the launcher, `python -m megatron_hdp.megatron_lm`) under the
test-only CUDA shims (`cpu_run.py`), and returns the loss and gradient norm Megatron-LM's
`training_log` got at every iteration (with its loss scale and whether the step was
skipped) and the loss of every evaluation.
"""

from __future__ import annotations

import importlib
import inspect
import os
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[2]
THIRD_PARTY = REPO.parent / "shared" / "third_party"

#: The model and optimizer, under flag names both pretrain_gpt.py and pretrain_hdp.py know
#: (`--vocab-size` as pretrain_hdp.py reads it; MEGATRON_CPU restates it for Megatron-LM).
SHARED = [
    "--num-layers", "2",
    "--hidden-size", "64",
    "--num-attention-heads", "4",
    "--ffn-hidden-size", "128",
    "--seq-length", "512",
    "--max-position-embeddings", "512",
    "--position-embedding-type", "rope",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--hidden-dropout", "0",
    "--lr", "1e-3",
    "--lr-decay-style", "constant",
    "--weight-decay", "0.01",
    "--clip-grad", "1.0",
    "--seed", "1234",
    "--split", "90,10,0",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "256",
    "--log-interval", "1",
]  # fmt: skip


def megatron_vocab_size(ids: int = 257) -> int:
    """Megatron-LM's `--vocab-size` for data of `ids` token ids whose last is end-of-document.

    Megatron-Core's NullTokenizer changed its meaning: in 0.16 `--vocab-size N` is N tokens
    plus end-of-document N (N + 1 ids, as `pretrain_hdp.py` reads it: SHARED's 256); in 0.19
    it is N ids in all, end-of-document N - 1 (257 for the same data).
    """
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    size = ids - (NullTokenizer(ids).vocab_size - ids)
    tokenizer = NullTokenizer(size)
    assert (tokenizer.vocab_size, tokenizer.eod) == (ids, ids - 1), (size, tokenizer.eod)
    return size


#: What a CPU run of Megatron-LM needs besides SHARED (unrelated to HDP), and last the data's
#: vocabulary as this Megatron-Core's NullTokenizer counts it (it overrides SHARED's).
MEGATRON_CPU = [
    "--micro-batch-size", "1",
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--attention-dropout", "0",
    "--rerun-mode", "disabled",
    "--vocab-size", str(megatron_vocab_size()),
]  # fmt: skip


def write_documents(prefix: Path) -> None:
    """200 documents of 20 to 700 byte tokens plus end-of-document 256 (257 token ids)."""
    from megatron_hdp.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 700, size=200)
    docs = [[*rng.integers(0, 256, size=int(n)).tolist(), 256] for n in lengths]
    write_indexed_dataset(prefix, docs, vocab_size=257)


def prepare_trees(tag: str, folder: Path) -> tuple[Path, Path]:
    """(stock, patched) copies of the Megatron-LM tree for `tag` under `folder`."""
    source = THIRD_PARTY / f"megatron-lm-{tag}"
    if not source.is_dir():
        pytest.skip(f"{source} is not here")
    stock, patched = folder / "stock", folder / "patched"
    shutil.copytree(source, stock)
    shutil.copytree(source, patched)
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        apply_megatron_patch = importlib.import_module("apply_megatron_patch")
    finally:
        sys.path.remove(str(REPO / "scripts"))
    apply_megatron_patch.apply(patched, tag)
    return stock, patched


def import_megatron_lm(tree: Path) -> None:
    """Put `tree` first on sys.path and import Megatron-LM's training package (parent)."""
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    importlib.import_module("megatron.training.training")
    importlib.import_module("gpt_builders")
    importlib.import_module("model_provider")


def _body_megatron_lm(rank, world_size, script, argv, launcher, env=None):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    for key, value in (env or {}).items():  # None: unset (as a launch script's `unset`)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from megatron.training import training

    from tests.megatron_lm.cpu_run import megatron_lm_cpu_shims

    records = {"train": [], "valid": [], "loss_scale": [], "steps": [], "model_chunks": None}
    stock_log, stock_evaluate = training.training_log, training.evaluate
    stock_train_step = training.train_step

    def train_step(*args, **kwargs):
        # Model chunks per stage (virtual pipeline stages), as the loop hands them over.
        # (Megatron-LM's positional order: forward_step_func, data_iterator, model, ...; a
        # test may have wrapped train_step in a function of (*args, **kwargs) already.)
        given = inspect.signature(stock_train_step).bind(*args, **kwargs).arguments
        model = given.get("model", kwargs.get("model", args[2] if len(args) > 2 else None))
        records["model_chunks"] = len(model) if isinstance(model, list) else 1
        return stock_train_step(*args, **kwargs)

    def training_log(*args, **kwargs):
        from megatron.training import get_args

        from megatron_hdp.megatron_lm import hooks

        given = inspect.signature(stock_log).bind(*args, **kwargs).arguments
        loss = given["loss_dict"].get("lm loss")
        if loss is not None:
            grad_norm = given["grad_norm"]
            records["train"].append(
                (given["iteration"], float(loss), None if grad_norm is None else float(grad_norm))
            )
            records["loss_scale"].append(
                (given["iteration"], float(given["loss_scale"]), int(given["skipped_iter"]))
            )
            # What Megatron-LM counted for the step, and (under --hdp) what HDP trained.
            lengths = hooks._SCHEDULE.trained_lengths
            records["steps"].append(
                {
                    "iteration": given["iteration"],
                    "consumed_samples": get_args().consumed_train_samples,
                    "lr": given["learning_rate"],
                    "lengths": None if lengths is None else [int(n) for n in lengths],
                    "flops": training.num_floating_point_operations(get_args(), 1),
                }
            )
        return stock_log(*args, **kwargs)

    def evaluate(*args, **kwargs):
        result = stock_evaluate(*args, **kwargs)
        if result[0] and "lm loss" in result[0]:
            records["valid"].append(float(result[0]["lm loss"]))
        return result

    training.training_log, training.evaluate = training_log, evaluate
    training.train_step = train_step
    try:
        with megatron_lm_cpu_shims():
            if launcher:
                from megatron_hdp.megatron_lm.__main__ import main

                main([str(script), *argv])
            else:
                sys.argv = [str(script), *argv]
                runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:  # Megatron-LM exits this way at --exit-interval
        if stop.code not in (0, None):
            raise
    finally:
        training.training_log, training.evaluate = stock_log, stock_evaluate
        training.train_step = stock_train_step
    return records


def run_megatron_lm(
    script: Path, world_size: int, argv: list[str], *, launcher=False, timeout_s=150, env=None
) -> dict:
    """Run Megatron-LM's `script` on `world_size` ranks; the last rank's records.

    `env`: environment variables each rank sets (None: unsets) after the defaults.
    """
    per_rank = run_ranks(
        _body_megatron_lm, world_size, script, list(argv), launcher, env, timeout_s=timeout_s
    )
    return per_rank[-1]


def _body_pretrain_hdp_validation(rank, world_size, argv):
    import logging

    from tests.e2e.harness import _body_main

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep()
    logging.getLogger("megatron_hdp.megatron.trainer").addHandler(handler)
    logging.getLogger("megatron_hdp.megatron.trainer").setLevel(logging.INFO)
    try:
        _body_main(rank, world_size, argv)
    finally:
        logging.getLogger("megatron_hdp.megatron.trainer").removeHandler(handler)
    return [float(line.rsplit(" ", 1)[1]) for line in lines if "validation loss" in line]


def pretrain_hdp_validation(world_size: int, argv: list[str]) -> list[float]:
    """The validation losses pretrain_hdp.py logs (rank 0; 4 decimals)."""
    return run_ranks(_body_pretrain_hdp_validation, world_size, list(argv), timeout_s=150)[0]
