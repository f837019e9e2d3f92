"""HDP in a training loop of your own (the integration kit, `megatron_hdp.megatron.schedule`).

Megatron-Core's model, DDP and optimizer; HDP's data iterator and schedule:

    torchrun --standalone --nproc-per-node 2 examples/custom_loop.py \
        --data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 256 --steps 3

PREFIX is a Megatron indexed dataset (`PREFIX.bin` / `PREFIX.idx`). Every rank of the job is
one HDP replica (a pool of WORLD_SIZE ranks): per step the iterator hands every rank the same
plan of the global batch and this rank's micro-batches, the schedule runs them (rings of
ranks for long documents) and Megatron-Core's `finalize_model_grads` syncs the gradients and
the token count over the pool. The losses are those of `pretrain_hdp.py` with the same flags.
If you use Megatron-LM's `pretrain_gpt.py`, you need none of this: add `--hdp` (README).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megatron_hdp.attention.kernels.registry import job_kernel
from megatron_hdp.data.sampler import parse_split
from megatron_hdp.data.training_data import DataConfig, build_training_data
from megatron_hdp.launch import init_distributed, megatron_device_context
from megatron_hdp.megatron.arguments import padded_vocab_size
from megatron_hdp.megatron.engine import OptimConfig, build_engine
from megatron_hdp.megatron.model import GPTConfig, model_parallel_dims
from megatron_hdp.megatron.schedule import HDPDataIterator, hdp_forward_backward
from megatron_hdp.megatron.step import StepRuntime


def forward_step(data_iterator, model):
    """One HDP micro-batch: the batch dict goes to the model with its `packed_seq_params`."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )

    def loss_func(output_tensor):
        mask = batch["loss_mask"].view(-1).float()
        loss_sum = torch.sum(output_tensor.view(-1).float() * mask)
        tokens = mask.sum().to(torch.int)
        return loss_sum, tokens, {"lm loss": torch.stack([loss_sum.detach(), tokens.float()])}

    return output, loss_func


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The example's flags (Megatron names)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-path", required=True)
    p.add_argument("--split", default="90,10,0")
    p.add_argument("--tokenizer-type", default="NullTokenizer")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=8,
        help="samples of --seq-length tokens per step, as in Megatron-LM (whole documents up "
        "to that many tokens)",
    )
    p.add_argument("--hdp-capacity", type=int, default=256, help="tokens per rank and pass")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train `--steps` steps; returns the global loss of each (every rank returns them)."""
    args = parse(argv)
    if not dist.is_initialized():
        init_distributed()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    data = build_training_data(
        DataConfig(
            blend=[(None, args.data_path)],
            split=parse_split(args.split),
            seq_length=args.seq_length,
            seed=args.seed,
            tokens_per_batch=args.global_batch_size * args.seq_length,
            tokenizer_type=args.tokenizer_type,
            vocab_size=args.vocab_size,
        )
    )
    cfg = GPTConfig(  # pretrain_hdp.py's --num-layers 2 --hidden-size 64 ... --swiglu
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        vocab_size=padded_vocab_size(data.vocab_size, 128),
        max_position_embeddings=args.seq_length,
        tie_embeddings=True,
        params_dtype="bfloat16" if device.type == "cuda" else "float32",
    )
    losses = []
    with megatron_device_context():  # the CPU shims Megatron-Core needs without CUDA
        layout = model_parallel_dims(cfg, dist.get_world_size()).initialize()
        try:
            engine = build_engine(
                cfg, OptimConfig(lr=1e-3, weight_decay=0.01, adam_beta2=0.999), seed=args.seed
            )
            config = engine.model.config  # what Megatron-LM's train() sets up
            config.finalize_model_grads_func = finalize_model_grads
            config.no_sync_func = engine.model.no_sync
            runtime = StepRuntime(
                group=layout.pool_group,
                job_group=layout.world_group,
                device=device,
                # The job's kernel for this device ("auto" alone is refused off the CPU).
                backend=job_kernel("auto", device, dtype=cfg.dtype, head_dim=cfg.head_dim),
            )
            schedule = hdp_forward_backward(runtime, cfg)
            batches = HDPDataIterator(
                data.train,
                data.datasets,
                pool_size=layout.dims.pool_size,
                capacity=args.hdp_capacity,
                vocab_size=data.vocab_size,
                pool_rank=layout.pool_rank,
            )
            try:
                for _ in range(args.steps):
                    engine.model.zero_grad_buffer()
                    engine.optimizer.zero_grad()
                    reports = schedule(
                        forward_step_func=forward_step, data_iterator=batches, model=[engine.model]
                    )
                    engine.optimizer.step()
                    engine.scheduler.step(increment=1)
                    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
                    dist.all_reduce(total, group=layout.pool_group)  # over the pool
                    losses.append(float(total[0] / total[1]))
                    if dist.get_rank() == 0:
                        print(f"step {len(losses)}: loss {losses[-1]:.6f}")  # noqa: T201
            finally:
                batches.close()
        finally:
            layout.destroy()
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
