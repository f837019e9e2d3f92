"""The data under `--hdp`: HDP's sampler and planner as Megatron-LM's "external" loaders.

`datasets_provider` stands in for `pretrain_gpt.py`'s `train_valid_test_datasets_provider`:
it opens the same datasets `pretrain_hdp.py` opens for the same flags and returns a training
loader (an `HDPDataIterator` with `save_state`, which Megatron-LM's checkpoint calls when
`dataloader_save` is set) and a validation loader that starts again at every evaluation.
On a resume it continues the training loader from the position stored in the checkpoint.
`--mock-data` reads Megatron-Core's synthetic documents instead (`mock_data`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import torch

from megatron_hdp.data.iterator import HDPDataIterator
from megatron_hdp.data.training_data import TrainingData
from megatron_hdp.megatron_lm.switch import continue_stock_data, saved_args, written_by_hdp

logger = logging.getLogger(__name__)

#: The file Megatron-LM's `maybe_save_dataloader_state` writes for data-parallel rank 0
#: (every pool rank holds the same sampler position, so one is enough).
STATE_FILE = "train_dataloader_dprank000.pt"


class TrainBatches(HDPDataIterator):
    """The training loader: `HDPDataIterator` plus the state methods Megatron-LM calls."""

    def __init__(self, *args, prefixes: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefixes = prefixes

    def save_state(self) -> dict:
        """The sampler position after the last batch trained (Megatron-LM's checkpoint hook)."""
        return {"sampler": self.state_dict(), "prefixes": self.prefixes}

    def restore_state(self, state: dict) -> None:
        """Continue after the batches `save_state` counted; refuses other datasets."""
        if state.get("prefixes") != self.prefixes:
            raise ValueError(
                f"the checkpoint was trained on {state.get('prefixes')}, this run reads "
                f"{self.prefixes}"
            )
        self.load_state_dict(state["sampler"])


class ValidBatches:
    """The validation loader: each evaluation (`eval_iters` batches) starts from the start.

    Megatron-LM's `evaluate` draws exactly `--eval-iters` batches per evaluation, so every
    evaluation sees the same batches, as in `pretrain_hdp.py`.
    """

    def __init__(self, data: TrainingData, eval_iters: int, make) -> None:
        self.data, self.eval_iters, self.make = data, eval_iters, make
        self.current: HDPDataIterator | None = None
        self.drawn = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.current is None or self.drawn == self.eval_iters:
            if self.current is not None:
                self.current.close()
            self.current, self.drawn = self.make(self.data.fresh_valid_sampler()), 0
        self.drawn += 1
        return next(self.current)


def _state_path(args: argparse.Namespace) -> str:
    return state_path(args, args.load, args.iteration)


def state_path(args: argparse.Namespace, folder: str, iteration: int) -> str:
    """Where a checkpoint of `folder` at `iteration` holds HDP's data position.

    One file: data-parallel rank 0, TP 0, stage 0, no expert-rank suffix.
    """
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(
        folder,
        iteration,
        pipeline_parallel=args.pipeline_model_parallel_size > 1,
        tensor_rank=0,
        pipeline_rank=0,
        expert_parallel=False,
        expert_rank=0,  # unused without expert parallelism; no process group needed
        basename=STATE_FILE,
    )


#: The loaders of model chunk 0, which the other chunks share (virtual pipeline stages).
_FIRST_CHUNK: dict = {}


def datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """Megatron-LM's dataset provider under `--hdp`: (train, valid, None) loaders.

    Runs on every rank (`is_distributed`); collective over nothing. With virtual pipeline
    stages Megatron-LM calls it once per model chunk (`vp_stage` 0, 1, ...); every chunk
    reads the same micro-batches, so chunks after the first get chunk 0's loaders (one
    sampler, one read-ahead; HDP's schedule draws from the first chunk's iterator only).
    """
    if vp_stage:
        if "loaders" not in _FIRST_CHUNK:
            raise RuntimeError(f"--hdp: model chunk {vp_stage}'s loaders before chunk 0's")
        return _FIRST_CHUNK["loaders"]
    loaders = _datasets(train_valid_test_num_samples)
    _FIRST_CHUNK["loaders"] = loaders
    return loaders


def _datasets(train_valid_test_num_samples):
    """`datasets_provider`'s loaders for model chunk 0 (or the only one)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.megatron.config import device_profile
    from megatron_hdp.megatron.model import model_shape
    from megatron_hdp.megatron_lm.args import capacity, global_batch
    from megatron_hdp.megatron_lm.mock_data import describe, mock_training_data
    from megatron_hdp.megatron_lm.model import gpt_config
    from megatron_hdp.scheduler.cost import CostModel

    args = get_args()
    tokens, ramp = global_batch(args)
    data_cfg = megatron_lm_data_config(args, tokens, ramp)
    if args.mock_data:
        data = mock_training_data(data_cfg)
        if torch.distributed.get_rank() == 0:
            logger.warning("%s", describe(data.datasets[0], args.seq_length))
    else:
        data = build_training_data(data_cfg)
    cfg = gpt_config(args)
    padded = gpt_config(args, vocab_size=_padded(data.vocab_size, args)).vocab_size
    if padded != cfg.vocab_size:
        raise ValueError(
            f"the data's vocabulary ({data.vocab_size}, padded {padded}) is not Megatron-LM's "
            f"(padded {args.padded_vocab_size}): check --tokenizer-type and --vocab-size"
        )
    profile = device_profile(args.hdp_device_profile).replica(args.tensor_model_parallel_size)
    pool = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    pool_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)

    def loader(sampler, cls=HDPDataIterator, depth=args.hdp_prefetch_depth, **extra):
        return cls(
            sampler,
            data.datasets,
            pool_size=pool,
            capacity=capacity(args),
            policy=args.hdp_placement,
            cost_model=CostModel(model_shape(cfg, args.hdp_attention_backend), profile),
            vocab_size=data.vocab_size,
            pipeline_stages=args.pipeline_model_parallel_size,
            virtual_stages=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
            pool_rank=pool_rank,
            prefetch_depth=depth,
            mtp_depth=cfg.mtp_num_layers or 0,
            **extra,
        )

    train = loader(data.train, TrainBatches, prefixes=data.prefixes)
    if args.load and args.iteration > 0 and not args.finetune:
        state, where = _saved_data_position(args)
        if state is None:  # a stock Megatron-LM checkpoint: `where` is its args
            note = continue_stock_data(train.sampler, args, where)
            if torch.distributed.get_rank() == 0:
                logger.warning("%s", note)
        else:
            train.restore_state(state)
            logger.info("HDP data position restored from %s", where)
    valid = None
    if data.fresh_valid_sampler() is not None and args.eval_iters > 0:
        valid = ValidBatches(data, args.eval_iters, lambda s: loader(s, depth=0))
    elif args.eval_iters > 0 and torch.distributed.get_rank() == 0:
        logger.warning(
            "--split %s leaves the validation split without documents: evaluations are "
            "skipped (no validation loss is logged; stock Megatron-LM fails there)",
            args.split,
        )
    return train, valid, None


datasets_provider.is_distributed = True


def _saved_data_position(args: argparse.Namespace) -> tuple[dict | None, object]:
    """The data position of the checkpoint `--load` resumes, and where it was found.

    An `--hdp` run of Megatron-LM keeps it in Megatron-LM's data-loader file; pretrain_hdp.py
    in the `hdp` entry of the checkpoint's common state. A checkpoint of stock Megatron-LM
    (no `--hdp`) has none: `(None, its saved args)` (`switch.continue_stock_data`). Raises
    ValueError for an HDP checkpoint that lost its position. Reads local files only.
    """
    from megatron.training.checkpointing import get_checkpoint_name

    from megatron_hdp.megatron.dist_checkpoint import is_dist_checkpoint, read_common

    path = _state_path(args)
    if os.path.exists(path):
        return torch.load(path, weights_only=False)["dataloader_state_dict"], path
    folder = get_checkpoint_name(args.load, args.iteration, return_base_dir=True)
    common = read_common(folder) if is_dist_checkpoint(folder) else None
    data_state = ((common or {}).get("hdp") or {}).get("data_state")
    if data_state is not None:
        return data_state, f"{folder} (written by pretrain_hdp.py)"
    ckpt_args = saved_args(args, args.iteration)
    if ckpt_args is not None and not written_by_hdp(common, ckpt_args):
        return None, ckpt_args
    raise ValueError(
        f"--hdp: the checkpoint of iteration {args.iteration} in {args.load} has no HDP data "
        f"position ({path} is missing) and is no stock Megatron-LM checkpoint (its args say "
        "--hdp, or it holds none): "
        "restore the file, or load with --finetune to start the data from its first batch"
    )


class MegatronLMTokenizer:
    """HDP's tokenizer interface over the tokenizer object Megatron-LM built.

    `vocab_size`, `eod`, `encode`, `decode` of `megatron.training.get_tokenizer()`. HDP's
    data layer then reads text exactly as Megatron-LM's `preprocess_data.py` writes it:
    `tokenize(text)` followed by the tokenizer's own end-of-document token (`eod`), for
    every `--tokenizer-type` Megatron-LM builds; and checks token ids against the
    vocabulary Megatron-LM padded its embedding from. No communication.
    """

    def __init__(self, tokenizer, tokenizer_type: str) -> None:
        """Raises ValueError naming the type if the tokenizer has no end-of-document token."""
        self.tokenizer, self.name = tokenizer, tokenizer_type
        self.vocab_size = int(tokenizer.vocab_size)
        try:
            eod = tokenizer.eod
        except (AttributeError, NotImplementedError, KeyError) as err:
            eod, why = None, f" ({type(err).__name__}: {err})"
        else:
            why = ""
        if eod is None:
            raise ValueError(
                f"--tokenizer-type {tokenizer_type}: the tokenizer Megatron-LM built has no "
                f"end-of-document token (its eod is None{why}); HDP splits documents at it "
                "(for HuggingFaceTokenizer: set eos_token in the tokenizer's folder)"
            )
        self.eod = int(eod)

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text`, as Megatron-LM's `tokenizer.tokenize(text)` gives them."""
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8", errors="replace")
        return [int(i) for i in self.tokenizer.tokenize(text)]

    def decode(self, ids) -> str:
        """Text of token ids (Megatron-LM's `detokenize`)."""
        return self.tokenizer.detokenize([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"MegatronLMTokenizer({self.name}, vocab_size={self.vocab_size}, eod={self.eod})"


def megatron_lm_data_config(args: argparse.Namespace, tokens: int, ramp=None):
    """HDP's data set-up for these flags, reading with the tokenizer Megatron-LM built.

    `tokens` / `ramp` are the global batch (`args.global_batch`): every step's token budget
    is `ramp.tokens_of_step(step)`, a function of the step index alone, so the batches the
    prefetch thread plans ahead get the budget Megatron-LM's calculator gives that step.
    The vocabulary, the end-of-document token and the tokenization of JSONL sources are those of
    `get_tokenizer()`, the tokenizer Megatron-LM padded its vocabulary from (for
    NullTokenizer: `--vocab-size N` is N + 1 ids with megatron-core 0.16, N with 0.19).
    """
    from megatron.training import get_tokenizer

    from megatron_hdp.megatron.config import batch_data_config

    return dataclasses.replace(
        batch_data_config(args, tokens_per_batch=tokens, ramp=ramp),
        tokenizer=MegatronLMTokenizer(get_tokenizer(), args.tokenizer_type),
    )


def _padded(vocab_size: int, args: argparse.Namespace) -> int:
    from megatron_hdp.megatron.arguments import padded_vocab_size

    return padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
