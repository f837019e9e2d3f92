"""Command-line arguments of `pretrain_hdp.py`: Megatron-LM's flag names plus `--hdp-*`.

`build_parser()` accepts the Megatron-LM flags this job implements, under their Megatron
names and with Megatron's defaults where the behaviour exists here. A Megatron-LM flag it
does not implement is refused by name (`UNSUPPORTED_MEGATRON_FLAGS`), never ignored.
`add_hdp_args(parser)` adds the HDP group alone; Megatron-LM users pass it as
`extra_args_provider` (see docs/megatron-lm.md).

`megatron_hdp.megatron.validation.validate_args` checks the parsed flags before any process
group exists. This module imports neither torch nor Megatron-Core, so parsing and
validation take well under a second.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from megatron_hdp.megatron.mla_args import add_mla_args
from megatron_hdp.scheduler.placement import POLICIES
from megatron_hdp.scheduler.windows import parse_skip_freq, parse_window_size

#: Megatron-LM flags that exist there but not here; refused with this message.
UNSUPPORTED_MEGATRON_FLAGS = {
    "--virtual-pipeline-model-parallel-size": "Megatron-LM's flag for virtual pipeline stages "
    "is --num-layers-per-virtual-pipeline-stage",
    "--decoder-first-pipeline-num-layers": "HDP splits the layers evenly over the stages",
    "--decoder-last-pipeline-num-layers": "HDP splits the layers evenly over the stages",
    "--pipeline-model-parallel-layout": "HDP splits the layers evenly over the stages",
    "--lr-warmup-fraction": "give --lr-warmup-iters",
    "--recompute-granularity": "activation recomputation is not supported (see offloading)",
    "--recompute-activations": "activation recomputation is not supported (see offloading)",
    "--use-flash-attn": "HDP chooses its attention kernel: --hdp-attention-backend",
    "--transformer-impl": "HDP uses Megatron-Core's local layers plus HDP attention",
    "--expert-tensor-parallel-size": "set from the layout: TP / --expert-model-parallel-size",
    "--hybrid-context-parallel": "HDP replaces Megatron's hybrid context parallelism",
    "--mock-data": "use the embedded default corpus (omit --data-path)",
    "--train-data-path": "give --data-path and --split",
    "--valid-data-path": "give --data-path and --split",
    "--test-data-path": "give --data-path and --split",
    "--vocab-file": "give --tokenizer-type and --tokenizer-model",
    "--merge-file": "give --tokenizer-type HuggingFaceTokenizer --tokenizer-model",
    "--use-mcore-models": "always Megatron-Core here",
    "--fp8-format": "fp8 needs Transformer Engine on GPU, not supported",
    "--optimizer": "only Adam(W) is supported",
}

#: `--hdp-attention-backend` choices (`attention.kernels.registry`, which needs torch).
ATTENTION_BACKENDS = (
    "auto",
    "torch",
    "math",
    "torch_flash",
    "torch_flash_fa3",
    "torch_flash_fa4",
    "flash_attn",
    "flash_attn_4",
)

TOKENIZERS = ("ByteLevel", "HuggingFaceTokenizer", "NullTokenizer")


class RefusingParser(argparse.ArgumentParser):
    """An ArgumentParser whose error for an unknown flag says whether Megatron has it."""

    def parse_args(self, args=None, namespace=None):
        """Parse; every unsupported or unknown flag of the launch is named in one error."""
        from megatron_hdp.errors import one_message

        parsed, unknown = self.parse_known_args(args, namespace)
        problems, rest, value_of_refused = [], [], False
        for item in unknown:
            flag = item.split("=", 1)[0]
            if flag in UNSUPPORTED_MEGATRON_FLAGS:
                problems.append(f"{flag} is not supported here: {UNSUPPORTED_MEGATRON_FLAGS[flag]}")
                value_of_refused = True
            elif not (value_of_refused and not item.startswith("-")):
                rest.append(item)
                value_of_refused = False
        if rest:
            problems.append(f"unknown arguments: {' '.join(rest)}")
        if problems:
            self.error(one_message(problems))
        return parsed


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (Megatron-LM names)")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="hidden size")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size (default 4 x hidden; with --swiglu, Megatron's 2/3 rule)",
    )
    g.add_argument("--num-attention-heads", type=int, required=True, help="query heads")
    g.add_argument(
        "--group-query-attention", action="store_true", help="use --num-query-groups KV heads"
    )
    g.add_argument(
        "--num-query-groups", type=int, default=1, help="KV heads with --group-query-attention"
    )
    g.add_argument(
        "--seq-length",
        type=int,
        required=True,
        help="maximum context: longer documents are split into pieces of this many tokens",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="positions the model supports (default --seq-length)",
    )
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="position embedding (Megatron's default: learned_absolute)",
    )
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base")
    g.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="share of each head's channels RoPE rotates (the first int(head dim x p); the "
        "rest pass through, as Megatron-Core)",
    )
    g.add_argument(
        "--rotary-interleaved",
        action="store_true",
        help="RoPE rotates interleaved channel pairs (0,1), (2,3), ... instead of the halves",
    )
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="channels per attention head (default hidden size / heads)",
    )
    g.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="normalise each head's queries and keys (the --normalization norm) before RoPE",
    )
    g.add_argument(
        "--softmax-type",
        choices=("vanilla", "off-by-one", "learnable"),
        default="vanilla",
        help="attention softmax (Megatron's meaning): off-by-one adds a sink logit 0 per head "
        "to every query row's denominator, learnable a learned sink logit per head "
        "(softmax_offset); see docs/attention-variants.md",
    )
    g.add_argument(
        "--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm", help="norm"
    )
    g.add_argument(
        "--window-size",
        type=parse_window_size,
        default=None,
        help="sliding-window attention 'left,0': each token attends to the left earlier "
        "tokens and itself (Megatron-Core's window_size; see docs/attention-variants.md)",
    )
    g.add_argument(
        "--window-attn-skip-freq",
        type=parse_skip_freq,
        default=None,
        help="which layers keep full attention with --window-size: N = every N-th layer, or a "
        "list expression of 1 (window) / 0 (full) per layer, e.g. '([1]*3+[0])*2'",
    )
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output layer (default: tied to the input embedding, as in Megatron)",
    )
    g.add_argument("--init-method-std", type=float, default=0.02, help="weight init std")
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="dropout of the attention probabilities, keyed by token so that every layout "
        "draws the same masks (Megatron's default is 0.1; 0 here; see docs/layouts.md)",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.0,
        help="dropout of the embeddings and the attention and MLP outputs, keyed by token "
        "(Megatron's default is 0.1; 0 here; see docs/layouts.md)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this",
    )
    g.add_argument("--bf16", action="store_true", help="bfloat16 parameters, fp32 main grads")
    g.add_argument(
        "--fp16",
        action="store_true",
        help="float16 parameters, fp32 main grads, the loss scaled by Megatron's grad scaler",
    )
    g.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="with --fp16: a constant loss scale (default: dynamic)",
    )
    g.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="with --fp16: the dynamic loss scale to start from",
    )
    g.add_argument(
        "--min-loss-scale", type=float, default=1.0, help="with --fp16: the smallest dynamic scale"
    )
    g.add_argument(
        "--loss-scale-window",
        type=float,
        default=1000,
        help="with --fp16: steps without overflow before the dynamic scale doubles",
    )
    g.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="with --fp16: overflowing steps before the dynamic scale halves",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training (Megatron-LM names)")
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="optimizer steps in total (or --train-samples)",
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="samples (of --seq-length tokens) to train, as Megatron-LM: the steps are "
        "derived from --global-batch-size and --rampup-batch-size; the learning-rate schedule "
        "then counts samples",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples of --seq-length tokens per step, as Megatron-LM: a step trains whole "
        "documents up to B x --seq-length tokens (default: one per data-parallel rank, pool / "
        "--context-parallel-size); alternative to --hdp-global-batch-tokens",
    )
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Megatron-LM's batch-size ramp: start at START samples per step and add "
        "INCREMENT every SAMPLES / ((--global-batch-size - START) / INCREMENT) consumed "
        "samples (each of --seq-length tokens) until --global-batch-size",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="must be 1: HDP forms micro-batches itself (packed up to the capacity)",
    )
    g.add_argument("--lr", type=float, required=True, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate after decay")
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine", "inverse-square-root"),
        default="linear",
        help="decay after warm-up",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    g.add_argument(
        "--lr-decay-iters", type=int, default=None, help="decay steps (default --train-iters)"
    )
    g.add_argument(
        "--lr-warmup-samples",
        type=int,
        default=0,
        help="with --train-samples: linear warm-up over this many samples (Megatron-LM's)",
    )
    g.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="with --train-samples: decay over this many samples (default --train-samples)",
    )
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip, 0 = off")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--seed", type=int, default=1234, help="weights and data order")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard optimizer state over the pool (ZeRO-1), reduce-scatter gradients",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="start the bucketed gradient reduce in the backward of each rank's last "
        "micro-batch if it runs on this rank alone (else right after the backward), as "
        "Megatron overlaps it with the last backward",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per gradient bucket with --overlap-grad-reduce (default: Megatron's, "
        "max(4e7, 1e6 x pool size))",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="accumulate and reduce gradients in float32: Megatron-LM's default with --bf16, "
        "and what float32 parameters do anyway",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="with --bf16: accumulate and reduce gradients in bfloat16 (half the gradient "
        "memory and reduce traffic, less exact)",
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks per HDP replica: the pool is world / TP replicas, a ring "
        "links the same TP rank of its member replicas",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages per HDP replica (Megatron's 1F1B schedule): the pool is world / "
        "(TP x PP) pipelines, each running its own number of micro-batches; a ring runs on "
        "the same stage of its member pipelines in lock step (--num-layers must divide evenly)",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per model chunk: each stage holds (layers per stage / this) chunks and "
        "runs Megatron's interleaved 1F1B (micro-batch lists padded to counts it accepts)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tensor parallelism: split the norm and dropout regions over the TP ranks "
        "along the tokens (each micro-batch is padded to a multiple of TP)",
    )
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="experts per MoE layer (Megatron's MoELayer; default: a dense MLP)",
    )
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="hidden size of each expert (default: --ffn-hidden-size)",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=0.0,
        help="weight of the load-balancing loss; HDP computes it per sequence, weighted by "
        "the sequence's share of the global batch, so it does not depend on the placement",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="ranks the experts are split over, inside one replica: must divide "
        "--tensor-model-parallel-size (EP folded onto the TP ranks)",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall"),
        default="allgather",
        help="how tokens reach the experts of the other EP ranks of the replica",
    )
    g.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="multi-token prediction: Megatron-Core's MTP block with this many depths, each "
        "predicting one token further; every rank reads the few tokens after its chunks, so "
        "the shifted inputs and labels stay inside their documents on rings too",
    )
    g.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="weight of the MTP losses, divided evenly over the depths (Megatron's default 0.1)",
    )
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="CP of the static baseline mesh; also sets the default --hdp-capacity",
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop (or skip, --hdp-skip-nonfinite-steps) a step whose global loss or gradient "
        "norm is not finite, before the update is applied; checked on every rank together",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
        help="on resume, take the learning-rate and weight-decay schedule from these flags "
        "instead of the checkpoint's (the step count still comes from the checkpoint)",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
        help="on resume, keep the checkpoint's learning-rate and weight-decay schedule even if "
        "these flags differ (without either flag a changed schedule is refused)",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="timeout of every collective and ring transfer; a rank that waits longer fails",
    )
    g.add_argument(
        "--exit-signal-handler",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on SIGTERM or SIGINT, every rank stops at the next step boundary, saves a "
        "checkpoint (with --save) and exits with status 0; a second identical signal stops at "
        "once (on by default here; opt-in in Megatron-LM)",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data (Megatron-LM names)")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="indexed dataset prefixes, optionally weighted: 'P', 'P1 P2' (weighted by their "
        "tokens) or 'W1 P1 W2 P2 ...' (weights are token shares); omitted: the embedded "
        "Python-stdlib corpus",
    )
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights over documents")
    g.add_argument(
        "--tokenizer-type", choices=TOKENIZERS, default="ByteLevel", help="tokenizer of the data"
    )
    g.add_argument(
        "--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer"
    )
    g.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary size, for NullTokenizer only"
    )
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="where the embedded corpus is built (default ~/.cache/megatron_hdp)",
    )
    g.add_argument(
        "--hdp-data-spec",
        default=None,
        metavar="FILE",
        help="a declarative data spec (JSON or YAML): sources with weights, length buckets "
        "and a schedule of weights over steps (see docs/data.md); instead of "
        "--data-path",
    )
    g.add_argument(
        "--hdp-data-service",
        choices=("local", "ray"),
        default="local",
        help="local: every rank plans each batch and reads its own tokens in-process; ray: "
        "one planner actor plans each batch for all ranks and source-loader actors read the "
        "tokens (training and evaluation; ranks hold the documents' lengths only), on the Ray "
        "cluster at --hdp-ray-address (needs 'pip install ray')",
    )
    g.add_argument(
        "--hdp-ray-address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster of --hdp-data-service ray (the head's GCS address, as "
        "'ray start --head' prints it); default: RAY_ADDRESS, else HOST:6379 of this node",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints and logging (Megatron-LM names)")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument(
        "--save-interval", type=int, default=None, help="steps between checkpoints (and at end)"
    )
    g.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch"),
        default="torch_dist",
        help="checkpoint format --save writes: torch_dist, Megatron's distributed format "
        "(Megatron-LM's layout and state dict; reshards over TP, PP and pool size on load). "
        "'torch' (the earlier per-rank torch.save files) is refused: folders in it are still "
        "read by --load, found by their files (docs/checkpoints.md)",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background (Megatron-Core's asynchronous save); the "
        "checkpoint becomes the latest once every rank's writes are done, and the job waits "
        "for the last one before it exits",
    )
    g.add_argument(
        "--dist-ckpt-optim-fully-reshardable",
        action="store_true",
        help="with --use-distributed-optimizer: save the optimizer state in Megatron's "
        "fully_reshardable form (loads at any TP, PP and pool size; gathered over the pool at "
        "each save) instead of dp_reshardable (loads at another pool size, same TP and PP)",
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="with --load: take the checkpoint's model weights only, and start at iteration "
        "0 with a fresh optimizer, schedule, RNG and data position (as Megatron-LM's "
        "--finetune)",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) when the iteration is a multiple of this",
    )
    g.add_argument("--log-interval", type=int, default=100, help="steps between log lines")
    g.add_argument("--eval-interval", type=int, default=1000, help="steps between evaluations")
    g.add_argument("--eval-iters", type=int, default=100, help="validation batches per eval")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    g.add_argument("--no-progress-bar", action="store_true", help="no progress bar on rank 0")


def add_hdp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--hdp-*` flags (usable as Megatron-LM's `extra_args_provider`)."""
    g = parser.add_argument_group("hybrid data parallelism")
    g.add_argument(
        "--hdp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="HDP placement (default); --no-hdp runs the static DP x CP mesh baseline",
    )
    g.add_argument(
        "--hdp-static-baseline",
        action="store_true",
        help="same as --no-hdp: pack to --seq-length, shard every pack over the CP group",
    )
    g.add_argument(
        "--hdp-placement",
        choices=[p for p in POLICIES if p != "static"],
        default="balanced",
        help="HDP placement: 'balanced' (ByteScale's balance scheduler, priced by the cost "
        "model) or 'greedy' (least-loaded rings and packs)",
    )
    g.add_argument(
        "--hdp-offload",
        action="store_true",
        help="selective activation offloading, a per-step choice: a long sequence gets "
        "fewer ranks and moves a share of its activations to host memory where that "
        "shortens the predicted step by >= 1%% against a wider ring (ByteScale Eq. 3, "
        "copies priced; balanced placement); logs say what it did",
    )
    g.add_argument(
        "--hdp-host-memory-gb",
        type=float,
        default=None,
        help="host memory for offloaded activations per process (one device): with "
        "--hdp-offload each process allocates exactly this once at start-up, pinned on GPU, "
        "and the planner offloads at most this (default: 50%% of the machine's available "
        "memory over its LOCAL_WORLD_SIZE processes, the smallest over the job's machines; "
        "refused before start-up when the processes of one machine would take more than 80%% "
        "of its available memory; a TP replica has TP times this)",
    )
    g.add_argument(
        "--hdp-device-profile",
        default=None,
        help="cost-model device profile: h100, a100, cpu, or a JSON file from "
        "'python -m megatron_hdp.megatron.calibrate' (default: h100 on GPU, cpu on CPU)",
    )
    g.add_argument(
        "--hdp-capacity",
        type=int,
        default=None,
        help="tokens per rank per micro-batch (default ceil(seq-length / context-parallel-size))",
    )
    g.add_argument(
        "--hdp-global-batch-tokens",
        type=int,
        default=None,
        help="global batch as a token budget (the paper's way); whole sequences are added "
        "while they fit",
    )
    g.add_argument(
        "--hdp-attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="varlen attention kernel, one call per ring step: auto (on CUDA torch_flash, "
        "else flash_attn; on CPU torch), torch / math (CPU kernels: aten's CPU flash kernels, "
        "a matmul reference; refused on CUDA), torch_flash (PyTorch's CUDA flash varlen ops), "
        "torch_flash_fa3 / torch_flash_fa4 (the same ops running FA3 or FA4, where this torch "
        "can switch to them), flash_attn (flash-attn 2.6-2.8), flash_attn_4 (the flash-attn-4 "
        "package, sm90/sm100). Checked before start-up "
        "against the device, dtype (GPU kernels need --bf16) and head dim; a kernel that "
        "cannot run stops the job with the reason",
    )
    g.add_argument(
        "--hdp-load-if-exists",
        default=None,
        metavar="DIR",
        help="resume from DIR if it holds a checkpoint, else start fresh (for requeued jobs; "
        "--load insists on a checkpoint)",
    )
    g.add_argument(
        "--hdp-metrics-file",
        default=None,
        help="append one JSON line per step (iteration, loss, lr, grad norm, tokens, seconds, "
        "data_wait_s, ranks per sequence, attention bytes, the cost model's step time for "
        "this plan and for the static mesh; the end-of-run summary is computed from them)",
    )
    g.add_argument(
        "--hdp-timeline-interval",
        type=int,
        default=None,
        metavar="N",
        help="every N steps and at the last step, record when each rank ran each of its "
        "micro-batches, beside the plan's prediction, in timelines/step-<iteration>.json "
        "next to --hdp-metrics-file ('python -m megatron_hdp.plot RUN_DIR' draws it; one "
        "gather to rank 0 on those steps; not with pipeline parallelism); default "
        "--log-interval, 0: off",
    )
    g.add_argument(
        "--hdp-prefetch-depth",
        type=int,
        default=2,
        metavar="N",
        help="plan the next N global batches and read this rank's tokens for them in a "
        "background thread while the current step trains (0: plan and read inside the step); "
        "the metrics file records each step's wait for data as data_wait_s",
    )
    g.add_argument(
        "--hdp-skip-nonfinite-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --check-for-nan-in-loss-and-grad: skip up to N non-finite steps in a row "
        "(no update, the LR schedule does not advance, the batch is consumed) before stopping; "
        "0 stops at the first",
    )
    g.add_argument(
        "--hdp-overwrite-checkpoints",
        action="store_true",
        help="allow a run that does not resume from --save to start there although the folder "
        "holds another run's checkpoints: they are deleted once this run's first checkpoint is "
        "published (a crash before that leaves them)",
    )
    g.add_argument(
        "--hdp-stall-report-seconds",
        type=float,
        default=None,
        metavar="S",
        help="log which rank holds up a step (and in which micro-batch) once the step has "
        "waited S seconds (default: a quarter of --distributed-timeout-minutes; 0: off)",
    )
    g.add_argument(
        "--hdp-validate-only",
        action="store_true",
        help="check every flag, path, data file and the checkpoint to resume for a job of "
        "WORLD_SIZE ranks (environment, default 1), then exit: 0 if it would start, 2 with a "
        "one-line message if not (the launch scripts run this before torchrun)",
    )
    g.add_argument(
        "--hdp-check-plans",
        action="store_true",
        help="all-gather plan hashes every step and stop if ranks disagree (debug)",
    )
    return parser


def build_parser() -> RefusingParser:
    """The whole `pretrain_hdp.py` parser."""
    parser = RefusingParser(
        prog="pretrain_hdp.py",
        description="Train a Megatron-Core GPT with Hybrid Data Parallelism (launch with "
        "torchrun).",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(parser)
    add_mla_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_args(parser)
    add_hdp_args(parser)
    return parser


def parse_data_path(items: Sequence[str] | None) -> list[tuple[float | None, str]]:
    """`--data-path` as `(weight, prefix)` pairs; `[]` when omitted.

    Without weights every prefix gets weight None: the data set-up then weights datasets by
    their training tokens, as Megatron weights an unweighted list by dataset size.
    """
    if not items:
        return []
    if len(items) == 1:
        return [(None, items[0])]
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        if any(_is_number(x) for x in items):
            raise ValueError(f"--data-path {' '.join(items)}: mix of weights and paths") from None
        return [(None, p) for p in items]
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: a weight without a path")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ValueError(f"--data-path weights must be finite and positive, got {bad[0]}")
    return list(zip(weights, items[1::2], strict=True))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def capacity_of(args: argparse.Namespace) -> int:
    """The token capacity per rank per micro-batch the job will use."""
    if args.hdp_capacity is not None:
        return args.hdp_capacity
    return math.ceil(args.seq_length / args.context_parallel_size)


def counts_samples(args: argparse.Namespace) -> bool:
    """Whether the learning-rate schedule counts samples, as Megatron-LM's always does.

    With --train-samples, a --lr-*-samples flag or --rampup-batch-size the schedule steps by
    each step's samples (its batch size changes with the ramp); otherwise by 1 per step,
    which is Megatron-LM's schedule divided by the constant --global-batch-size.
    """
    return bool(
        getattr(args, "train_samples", None)
        or getattr(args, "lr_decay_samples", None)
        or getattr(args, "lr_warmup_samples", 0)
        or getattr(args, "rampup_batch_size", None)
    )


def schedule_steps(args: argparse.Namespace) -> tuple[int, int | None]:
    """(warm-up, decay end) of the learning-rate schedule, in the unit it counts.

    In samples (`counts_samples`) as Megatron-LM's `get_optimizer_param_scheduler`:
    --lr-warmup-samples and --lr-decay-samples (default --train-samples) with
    --train-samples, else the --lr-*-iters x --global-batch-size. Otherwise in steps. The
    decay end is None for a run whose decay is never reached (no --lr-decay-iters and no
    --train-iters: validation gives one of them).
    """
    if not counts_samples(args):
        return args.lr_warmup_iters, args.lr_decay_iters or args.train_iters
    if args.train_samples:
        return args.lr_warmup_samples, args.lr_decay_samples or args.train_samples
    batch = args.global_batch_size
    return args.lr_warmup_iters * batch, (args.lr_decay_iters or args.train_iters) * batch


def uses_static_mesh(args: argparse.Namespace) -> bool:
    """True when the job runs the static DP x CP baseline instead of HDP."""
    return (not args.hdp) or args.hdp_static_baseline


def padded_vocab_size(vocab_size: int, multiple: int, tensor_parallel: int = 1) -> int:
    """Megatron's vocabulary padding: a multiple of `--make-vocab-size-divisible-by` x TP."""
    multiple *= tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def megatron_ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's default MLP size: 4 h, or int(8 h / 3 / 64) * 64 with SwiGLU."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 4 * args.hidden_size
    return 4 * args.hidden_size


def model_chunks(args: argparse.Namespace) -> int | None:
    """Model chunks per stage from `--num-layers-per-virtual-pipeline-stage` (None: one).

    As Megatron-LM: layers per stage / layers per chunk, None when that is 1. Raises
    ValueError naming the values when they do not divide or there is no pipeline.
    """
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is None:
        return None
    pp = args.pipeline_model_parallel_size
    per_stage = args.num_layers // pp if pp > 0 else 0
    if per_chunk < 1 or pp < 2 or per_stage % per_chunk:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_chunk}: needs "
            f"--pipeline-model-parallel-size > 1 (got {pp}) and must divide the "
            f"{per_stage} layers of each stage (--num-layers {args.num_layers})"
        )
    chunks = per_stage // per_chunk
    return chunks if chunks > 1 else None
