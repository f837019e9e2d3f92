"""The hooks that make Megatron-LM's `pretrain()` train with HDP under `--hdp`.

`hdp_pretrain(pretrain)` wraps Megatron-LM's `pretrain`: called as `pretrain_gpt.py` calls
it, it adds `--hdp` and the `--hdp-*` flags to Megatron-LM's parser (its
`extra_args_provider`) and, when the parsed arguments have `--hdp`, swaps in HDP's dataset
provider, model builder and forward step. It also installs two run-time hooks where
Megatron-LM's `pretrain()` takes no argument:

- `validate_args` (in `megatron.training.initialize` at core_v0.16.1, in
  `megatron.training.arguments` at core_v0.19.0): HDP's checks before and after
  Megatron-LM's own, before any process group exists (`args.check_args`, `finish_args`);
- `megatron.training.training.get_forward_backward_func`: HDP's schedule
  (`megatron.schedule.hdp_forward_backward`) for training and evaluation;
- `megatron.training.training.num_floating_point_operations` (the FLOPs of
  `--log-throughput` and of the FLOP counter in checkpoints): under `--hdp` those of the
  sequences the last training step really trained (`trained_flops`), not `--global-batch-size`
  samples of `--seq-length` tokens;
- `megatron.training.checkpointing.maybe_save_dataloader_state`: under `--hdp` global rank 0
  alone writes the data position (`save_data_position`: it is the same on every rank), where
  `--load` reads it; Megatron-LM's own writes one file per data-parallel rank into folders
  named by the expert rank too, which only the expert rank 0 ranks create (experts across
  replicas crashed there);
- `megatron.training.training.evaluate_and_print_results`: under `--hdp` an evaluation with
  no loader (a `--split` that leaves the split without documents) is skipped, not failed.

Every hook reads `get_args().hdp` when it runs: without `--hdp` each one calls the stock
function it replaced, so the job is stock Megatron-LM. The patch
(`patches/<tag>/`) calls `hdp_pretrain` from `pretrain_gpt.py`; the launcher
(`python -m megatron_hdp.megatron_lm`) installs it into an unmodified checkout. The schedule
and its process groups are built once per process, so in-process restarts are refused.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
from functools import partial

import torch

logger = logging.getLogger(__name__)


def _hdp_on() -> bool:
    from megatron.training import get_args

    return bool(getattr(get_args(), "hdp", False))


class _Either:
    """Calls `hdp` when the job runs with `--hdp`, else `stock` (decided at call time)."""

    def __init__(self, stock, hdp) -> None:
        self.stock, self.hdp = stock, hdp
        self.__wrapped__ = stock  # inspect.signature: Megatron-LM checks the stock one's
        functools.update_wrapper(self, stock, updated=())

    @property
    def is_distributed(self) -> bool:
        """Megatron-LM builds the datasets on every rank if true (HDP needs every rank's)."""
        return _hdp_on() or bool(getattr(self.stock, "is_distributed", False))

    def __call__(self, *args, **kwargs):
        return (self.hdp if _hdp_on() else self.stock)(*args, **kwargs)


def with_hdp_args(extra_args_provider):
    """An `extra_args_provider` that adds HDP's flags after the script's own (if any)."""
    from megatron_hdp.megatron_lm.args import add_args

    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_args(parser)

    return provider


def hdp_model_provider(pre_process=True, post_process=True, vp_stage=None, **kwargs):
    """Megatron-LM's model provider under `--hdp` (`model.hdp_gpt_builder`)."""
    from megatron.training import get_args

    from megatron_hdp.megatron_lm.model import hdp_gpt_builder

    args = get_args()
    if not getattr(args, "hdp_checked", False):
        raise ValueError("--hdp: the HDP argument checks did not run (--yaml-cfg is not supported)")
    if getattr(args, "modelopt_enabled", False):
        # Megatron-LM sets it only here, at model building: a --load checkpoint with ModelOpt
        # state. It would then build ModelOpt's model (--enable-gpt-oss's YaRN RoPE included).
        raise ValueError(
            f"--hdp: --load {args.load} is a ModelOpt checkpoint; HDP builds Megatron-LM's GPT "
            "model, not ModelOpt's (load a plain Megatron checkpoint)"
        )
    return hdp_gpt_builder(args, pre_process, post_process, vp_stage, **kwargs)


def _loss_func(loss_mask, output_tensor, model=None):
    """Per-token loss sum, token count and report, as `pretrain_gpt.loss_func` returns."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def hdp_forward_step(loss_func):
    """A `forward_step(data_iterator, model)` for HDP micro-batch dicts.

    Megatron-LM's stock `get_batch` rebuilds the batch from fixed keys and drops
    `packed_seq_params` (and returns nothing on middle pipeline stages), so the batch dict
    goes to the model as it is; `loss_func(loss_mask, output_tensor, model=...)` is the
    script's own (`pretrain_gpt.loss_func`: NaN checks, spiky-loss checks).
    """

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        if return_schedule_plan:
            raise ValueError("--hdp does not support --overlap-moe-expert-parallel-comm")
        batch = next(data_iterator)
        # With multi-token prediction the MTP loss masks travel in `packed_seq_params`
        # (`megatron.mtp`); given a loss mask, Megatron-Core 0.19 would rescale by its sum.
        mtp = getattr(batch["packed_seq_params"], "mtp", None) is not None
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch["attention_mask"],
            labels=batch["labels"],
            loss_mask=None if mtp else batch["loss_mask"],
            packed_seq_params=batch["packed_seq_params"],
        )
        return output, partial(loss_func, batch["loss_mask"], model=model)

    return forward_step


class _Schedule:
    """HDP's forward/backward function, built on first use (after the process groups)."""

    def __init__(self) -> None:
        self.schedule = None
        self.runtime = None
        self.trained_lengths = None  # of the last training step's sequences (FLOP counts)

    def _build(self):
        from megatron.core import parallel_state
        from megatron.training import get_args

        from megatron_hdp.megatron.schedule import hdp_forward_backward
        from megatron_hdp.megatron.step import StepRuntime
        from megatron_hdp.megatron_lm.model import gpt_config

        args = get_args()
        cfg = gpt_config(args)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        pp = args.pipeline_model_parallel_size
        self.runtime = StepRuntime(
            group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            job_group=torch.distributed.group.WORLD,
            pipeline_group=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
            backend=args.hdp_attention_backend,
            device=device,
            check_plans=args.hdp_check_plans,
            seed=args.seed,
            mtp_depth=cfg.mtp_num_layers or 0,
        )
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        # Megatron-LM's training_log divides the MoE loss tracker by its micro-batch count.
        self.schedule = hdp_forward_backward(
            self.runtime, cfg, moe_tracker_scale=get_num_microbatches
        )

    def __call__(self, *, data_iterator, **kwargs):
        """Collective over the HDP pool (and the pipeline): one step of HDP micro-batches."""
        if self.schedule is None:
            self._build()
        from megatron.training import get_args

        # Keys this step's dropout masks (Megatron-LM sets it before each train_step).
        self.runtime.iteration = int(getattr(get_args(), "curr_iteration", 0) or 0)
        if isinstance(data_iterator, list):
            # Virtual pipeline stages: one iterator per model chunk, all over the same
            # loader (`data.datasets_provider`); the step is drawn once.
            data_iterator = data_iterator[0]
        step = next(data_iterator)
        if self.runtime.check_plans:
            from megatron_hdp.distributed.plan_check import check_plan_agreement

            check_plan_agreement(step.plan, self.runtime.all_ranks, self.runtime.device)
        if not kwargs.get("forward_only", False):
            self.trained_lengths = step.plan.lengths.copy()
        return self.schedule(data_iterator=iter([step]), **kwargs)


_SCHEDULE = _Schedule()
_INSTALLED: dict = {}


def trained_flops(stock, args, lengths) -> float:
    """Megatron-LM's FLOP count (`stock`) of a step that trained sequences of `lengths`.

    `stock` is its `num_floating_point_operations`; each sequence counts as a sample of
    its own length.

    Token-linear work counts every trained token once and attention the square of each
    sequence's own length; padding is in no length. core_v0.19.0's function takes the sums
    itself (`total_real_tokens_in_batch`, `seqlen_squared_sum_in_batch`, its THD path);
    core_v0.16.1's is linear in the samples of one `--seq-length`, so it is summed over the
    distinct lengths with `seq_length` set to each.
    """
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    if "total_real_tokens_in_batch" in inspect.signature(stock).parameters:
        return stock(
            args,
            len(lengths),
            seqlen_squared_sum_in_batch=float((lengths.astype(np.float64) ** 2).sum()),
            total_real_tokens_in_batch=float(lengths.sum()),
        )
    total = 0.0
    for length, count in zip(*np.unique(lengths, return_counts=True), strict=True):
        one = copy.copy(args)
        one.seq_length = int(length)
        total += stock(one, int(count))
    return total


def _counted_flops(stock):
    """`num_floating_point_operations` that, under `--hdp`, counts the sequences trained."""

    def num_floating_point_operations(args, batch_size, *rest, **kwargs):
        lengths = _SCHEDULE.trained_lengths
        if not getattr(args, "hdp", False) or lengths is None:
            return stock(args, batch_size, *rest, **kwargs)
        return trained_flops(stock, args, lengths)

    num_floating_point_operations.__wrapped__ = stock
    return num_floating_point_operations


def save_data_position(train_iterator, iteration, dataloader_save_path) -> None:
    """Under `--hdp`: HDP's data position into the checkpoint, written by global rank 0.

    HDP's training iterator draws every step of the pool from one sampler, so its state is
    the same on every rank; `--load` reads the copy of data-parallel rank 0, TP 0, stage 0
    (`data.STATE_FILE`, no expert-rank suffix). Not collective (the checkpoint's own saves
    around it are).
    """
    if dataloader_save_path is None or torch.distributed.get_rank() != 0:
        return
    if isinstance(train_iterator, list):  # virtual pipeline stages: the chunks share it
        train_iterator = train_iterator[0]
    import os

    from megatron.training import get_args

    from megatron_hdp.megatron_lm.data import state_path

    path = state_path(get_args(), dataloader_save_path, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"dataloader_state_dict": train_iterator.iterable.save_state()}
    torch.save(state, path)


def _either_save_position(stock):
    def maybe_save_dataloader_state(train_iterator, iteration, dataloader_save_path, **groups):
        # core_v0.19.0 also passes its process groups (tp_group, pp_group, dp_group, ...)
        if _hdp_on():
            return save_data_position(train_iterator, iteration, dataloader_save_path)
        return stock(train_iterator, iteration, dataloader_save_path, **groups)

    maybe_save_dataloader_state.__wrapped__ = stock
    return maybe_save_dataloader_state


def _either_evaluate(stock):
    """`evaluate_and_print_results` that, under `--hdp`, skips a split with no loader.

    HDP's dataset provider gives no validation loader when `--split` leaves the validation
    split without documents (it logs so); Megatron-LM still evaluates, since it tests its
    list of loaders, not the loader, and would fail on the missing iterator. The same on
    every rank (the split is the same everywhere), so no collective is skipped unevenly.
    """
    signature = inspect.signature(stock)

    def evaluate_and_print_results(*args, **kwargs):
        if _hdp_on() and signature.bind(*args, **kwargs).arguments.get("data_iterator") is None:
            return None
        return stock(*args, **kwargs)

    evaluate_and_print_results.__wrapped__ = stock
    return evaluate_and_print_results


def _checked_validate_args(validate_args):
    from megatron_hdp.megatron_lm.args import check_args, finish_args

    def validate(args, defaults=None, *rest, **kwargs):
        try:
            check_args(args)
            result = validate_args(args, {} if defaults is None else defaults, *rest, **kwargs)
            finish_args(args)
        except ValueError as err:  # bad input: one line, before any process group
            sys.stderr.write(f"{sys.argv[0]}: error: {err}\n")
            raise SystemExit(2) from None
        if getattr(args, "hdp", False):
            args.hdp_checked = True
        return result

    validate.__wrapped__ = validate_args
    return validate


def install_hooks() -> None:
    """Install the run-time hooks into Megatron-LM (once; idempotent).

    `validate_args` is wrapped where Megatron-LM calls it: `megatron.training.initialize`
    (core_v0.16.1, inside `pretrain()`) and `megatron.training.arguments` (core_v0.19.0,
    `parse_and_validate_args`, which the script calls itself). Every hook calls the stock
    function without `--hdp`.
    """
    if _INSTALLED:
        return
    from megatron.training import arguments, initialize, training

    stock_schedule = training.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        return _SCHEDULE if _hdp_on() else stock_schedule(*args, **kwargs)

    for module in (initialize, arguments):
        if hasattr(module, "validate_args"):
            _INSTALLED[(module.__name__, "validate_args")] = module.validate_args
            module.validate_args = _checked_validate_args(module.validate_args)
    _INSTALLED[(training.__name__, "get_forward_backward_func")] = stock_schedule
    training.get_forward_backward_func = get_forward_backward_func
    _INSTALLED[(training.__name__, "num_floating_point_operations")] = (
        training.num_floating_point_operations
    )
    training.num_floating_point_operations = _counted_flops(training.num_floating_point_operations)
    _INSTALLED[(training.__name__, "evaluate_and_print_results")] = (
        training.evaluate_and_print_results
    )
    training.evaluate_and_print_results = _either_evaluate(training.evaluate_and_print_results)
    from megatron.training import checkpointing

    _INSTALLED[(checkpointing.__name__, "maybe_save_dataloader_state")] = (
        checkpointing.maybe_save_dataloader_state
    )
    checkpointing.maybe_save_dataloader_state = _either_save_position(
        checkpointing.maybe_save_dataloader_state
    )


def hdp_pretrain(pretrain, *, loss_func=None):
    """Megatron-LM's `pretrain` with `--hdp`: same arguments, same behaviour without the flag.

    Installs the run-time hooks (`install_hooks`) now, so that a script which parses its
    arguments before calling `pretrain` (core_v0.19.0) is checked too. `loss_func(loss_mask,
    output_tensor, model=None)` is the script's loss function; default: the `loss_func`
    beside the script's `forward_step` (`pretrain_gpt.py`'s), else an equivalent per-token
    loss.

    core_v0.16.1's `pretrain` parses the arguments itself: the HDP flags go to its
    `extra_args_provider`. core_v0.19.0's takes a config container built from arguments the
    script parsed (give `with_hdp_args(...)` to `parse_and_validate_args`); with `--hdp` its
    model config is dropped so that `pretrain` builds the model with HDP's model provider.
    """
    install_hooks()
    parameters = inspect.signature(pretrain).parameters

    @functools.wraps(pretrain)
    def pretrain_with_hdp(*args, **kwargs):
        from megatron_hdp.megatron_lm.data import datasets_provider

        bound = inspect.signature(pretrain).bind(*args, **kwargs)
        given = bound.arguments
        forward_step_func = given["forward_step_func"]
        losses = loss_func
        if losses is None:
            losses = getattr(forward_step_func, "__globals__", {}).get("loss_func", _loss_func)
        given["train_valid_test_dataset_provider"] = _Either(
            given["train_valid_test_dataset_provider"], datasets_provider
        )
        given["forward_step_func"] = _Either(forward_step_func, hdp_forward_step(losses))
        if "cfg_container" in parameters:  # core_v0.19.0: arguments parsed by the script
            if _hdp_on():
                container = copy.copy(given["cfg_container"])
                container.model = None  # pretrain() then calls the model provider
                given["cfg_container"] = container
                given["model_provider"] = hdp_model_provider
        else:
            given["model_provider"] = _Either(given["model_provider"], hdp_model_provider)
            given["extra_args_provider"] = with_hdp_args(given.get("extra_args_provider"))
        return pretrain(*bound.args, **bound.kwargs)

    return pretrain_with_hdp
