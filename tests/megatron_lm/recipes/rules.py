"""How the tests shrink NVIDIA's setups (the `*.args` beside this file) to run on CPU.

Every change to a recipe's flag list is one row of a table here; nothing else is changed
(`tests/megatron_lm/recipe_harness.py` applies them, in this order):

1. STOCK_FIXES: where stock Megatron-LM itself refuses the setup, the minimal fix, applied
   to both runs of a test (and named in the flag list's `# stock-fix:` header);
2. SIZES: model, batch, schedule sizes, replaced only where the recipe passes the flag;
3. LAYOUTS: world size and TP / PP / CP / EP of the multi-rank run (<= 4 ranks), replaced
   only where the recipe passes the flag (the 1-rank reference sets them all to 1 and
   drops ONE_RANK_DROP);
4. CPU_SET / CPU_DROP / CPU_DROP_VALUES / the CPU flag set: what stock Megatron-LM cannot
   run on a CPU either (Transformer Engine -> local, FP8 off, Megatron-FSDP, DeepEP /
   HybridEP dispatch, CUDA profiling and memory logging, NCCL -> gloo) and W&B (a network
   service);
5. PATHS: data, tokenizer, checkpoint and log paths -> the tests' files and folders.

`--mock-data` stays: it is what the recipe uses. A value given as a function of the recipe's
own value (a callable) is noted in its comment.
"""

from __future__ import annotations

#: Sizes. `None` keeps the recipe's value; a callable maps the recipe's values.
SIZES: dict[str, object] = {
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--num-attention-heads": ["4"],
    "--num-query-groups": ["2"],
    "--kv-channels": ["16"],  # = hidden / heads, as every recipe that sets it has it
    "--seq-length": ["512"],
    "--max-position-embeddings": ["512"],
    "--make-vocab-size-divisible-by": ["128"],
    # mixture of experts and multi-latent attention
    "--num-experts": ["4"],
    "--moe-ffn-hidden-size": ["128"],
    "--moe-shared-expert-intermediate-size": ["128"],
    "--moe-router-topk": ["2"],
    "--moe-router-num-groups": ["2"],
    "--moe-router-group-topk": ["1"],
    "--moe-layer-freq": ["[0]*1+[1]*1"],  # DeepSeek-V3's 3 dense + 58 MoE, for 2 layers
    "--q-lora-rank": ["32"],
    "--kv-lora-rank": ["32"],
    "--qk-head-dim": ["16"],
    "--qk-pos-emb-head-dim": ["8"],
    "--v-head-dim": ["16"],
    # batch and schedule: 3 steps of 8 sequences (a ramp 4 -> 8 where the recipe ramps)
    "--global-batch-size": ["8"],
    "--rampup-batch-size": ["4", "4", "8"],
    "--step-batch-size-schedule": ["0:4 2K:8"],
    "--train-iters": ["3"],
    "--train-samples": ["24"],
    "--lr-decay-iters": ["6"],
    "--lr-decay-samples": ["48"],
    "--lr-warmup-iters": ["1"],
    "--lr-warmup-samples": ["8"],
    "--eval-iters": lambda values: [str(min(int(values[0]), 1))],  # 0 stays 0, else 1
}

#: Per setup: the multi-rank run's world size and the parallel sizes that replace the
#: recipe's (only where it passes the flag); "chunks": the model chunks per stage the run
#: must build (virtual pipeline stages, from the recipe's own flag; default 1). Each
#: dimension above 1 in the recipe stays above 1 where 4 ranks allow; CP2 (TP2 PP2 CP2 =
#: 8) keeps PP2 x CP2.
LAYOUTS: dict[str, dict] = {
    "G175": {"world": 4, "tp": 2, "pp": 2},
    "G175'": {"world": 4, "tp": 2, "pp": 2},
    "L8": {"world": 2},
    "L8'": {"world": 2},
    "L8m": {"world": 2},
    "MX": {"world": 4, "pp": 2, "ep": 2},
    "LF'": {"world": 2},
    "OSS'": {"world": 4, "pp": 2},
    "DS'": {"world": 2, "ep": 2},
    "R15": {"world": 4, "tp": 2},
    "CKA": {"world": 2},
    "RC": {"world": 2},
    "CP4": {"world": 4, "pp": 2, "cp": 2},
    "VP": {"world": 4, "pp": 2, "chunks": 2},
    "CP2": {"world": 4, "pp": 2, "cp": 2},
    "TPO": {"world": 4, "tp": 2, "pp": 2},
    "CPF8": {"world": 4, "tp": 2, "cp": 2},
}
LAYOUT_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
}
#: Flags the 1-rank reference drops, as what only a pipeline can run: interleaved stages
#: (Megatron-LM asserts PP > 1 for them); the reference is the same model without them.
ONE_RANK_DROP = ("--num-layers-per-virtual-pipeline-stage",)
#: Sizes that follow the layout: CP's hierarchical split (its product must be CP), per run
#: (Megatron-LM wants it with --cp-comm-type a2a+p2p even for CP 1).
LAYOUT_SIZES = {
    "--hierarchical-context-parallel-sizes": lambda cp: ["1", str(cp)],
}

#: Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP: the
#: 1-rank reference (TP 1) multiplies the divisor (the recipe's, else Megatron-LM's 128) by
#: the multi-rank run's TP, so both runs have the same padded vocabulary (a size).
VOCAB_DIVISOR_DEFAULT = 128

#: Per setup, sizes that differ from SIZES (and why).
SIZE_OVERRIDES: dict[str, dict] = {
    # Megatron-LM needs every ramp stage divisible by micro-batch (4) x data-parallel (2)
    # 48 samples: 4 steps with the ramp (8, 8, 16, 16: core_v0.16.1), 3 without it
    # (core_v0.19.0 ignores --rampup-batch-size)
    "R15": {
        "--global-batch-size": ["16"],
        "--rampup-batch-size": ["8", "8", "16"],
        "--train-samples": ["48"],
    },
    # 2 layers on PP2 leave one layer per stage, too few for virtual stages of 1 layer
    "VP": {"--num-layers": ["4"]},
}

#: Stock Megatron-LM refuses these setups as NVIDIA's files give them; the minimal fix,
#: applied to the recipe before shrinking, in both runs (`# stock-fix:` in the header).
#: Each is (operation, flag, values): "set" replaces the values, "drop" removes the flag,
#: "join" makes the values one argument, "split" splits one argument on blanks,
#: "to_samples" turns an iteration count into samples (x --global-batch-size) under the
#: flag named by the values.
STOCK_FIXES: dict[str, list[tuple]] = {
    "G175": [
        ("to_samples", "--train-iters", ["--train-samples"]),
        ("to_samples", "--lr-decay-iters", ["--lr-decay-samples"]),
    ],
    "G175'": [
        ("join", "--step-batch-size-schedule", None),
        ("drop", "--global-batch-size", None),
    ],
    "OSS'": [("set", "--pipeline-model-parallel-size", ["4"])],
    "CP4": [("split", "--hierarchical-context-parallel-sizes", None)],
}
#: Fixes needed on one tree only: core_v0.19.0 accepts G175 as it is (there
#: --rampup-batch-size is deprecated, and Megatron-Core ignores it with a warning).
STOCK_FIX_ONLY_AT = {"G175": "core_v0.16.1"}

#: Flags stock Megatron-LM cannot run on a CPU either: new values.
CPU_SET = {
    "--transformer-impl": ["local"],  # Transformer Engine is CUDA-only (added if absent)
    "--distributed-backend": ["gloo"],  # NCCL is CUDA-only
}
#: Flags dropped, and why.
CPU_DROP = {
    "--fp8-format": "FP8 GEMMs are Transformer Engine's (CUDA)",
    "--fp8-recipe": "FP8",
    "--fp8-amax-history-len": "FP8",
    "--fp8-amax-compute-algo": "FP8",
    "--fp8-param-gather": "FP8",
    "--apply-layernorm-1p": "TE norms; stock refuses it with --transformer-impl local",
    "--moe-grouped-gemm": "GroupedGEMM kernels (stock validate_args asks the CUDA capability)",
    "--moe-permute-fusion": "TE's fused permutation (stock's TransformerConfig asks for TE)",
    "--moe-flex-dispatcher-backend": "flex dispatch (DeepEP / HybridEP CUDA kernels)",
    "--use-megatron-fsdp": "Megatron-FSDP (megatron_fsdp allocates on CUDA, CUDA streams)",
    "--data-parallel-sharding-strategy": "Megatron-FSDP",
    "--fsdp-double-buffer": "Megatron-FSDP",
    "--fsdp-manual-registration": "Megatron-FSDP (NCCL user buffers)",
    "--megatron-fsdp-grad-comm-dtype": "Megatron-FSDP",
    "--megatron-fsdp-main-grads-dtype": "Megatron-FSDP",
    "--use-nccl-ub": "NCCL user buffers (NCCL is CUDA-only)",
    "--init-model-with-meta-device": "without Megatron-FSDP stock materialises the meta-device "
    "model on torch.device('cuda')",
    "--profile": "CUDA profiler",
    "--profile-step-start": "CUDA profiler",
    "--profile-step-end": "CUDA profiler",
    "--profile-ranks": "CUDA profiler",
    "--record-memory-history": "CUDA memory",
    "--log-memory-to-tensorboard": "torch.cuda.memory_stats",
    "--exit-duration-in-mins": "Megatron-LM checks it with a CUDA tensor",
    "--enable-gpt-oss": "ModelOpt's builder only (not a CPU matter): Megatron-LM reads it "
    "when it builds ModelOpt's model (a ModelOpt --load or a teacher), never here; "
    "core_v0.19.0's pretrain_gpt.py parses it only with nvidia-modelopt installed (not here)",
    "--export-force-local-attention": "ModelOpt's builder only, as --enable-gpt-oss",
    "--wandb-project": "W&B is a network service (not a CPU matter; no network here)",
    "--wandb-entity": "W&B",
    "--wandb-exp-name": "W&B",
    "--wandb-save-dir": "W&B",
}
#: Values dropped from a flag's values (the flag goes with its last value), and why.
CPU_DROP_VALUES = {
    ("--recompute-modules", "layernorm"): "Megatron-Core's CheckpointWithoutOutput asks TE's "
    "FP8 state (a NameError without TE)",
    ("--ckpt-format", "fsdp_dtensor"): "Megatron-FSDP's format (stock asserts Megatron-FSDP "
    "for it); Megatron-LM's default format runs instead",
}
#: Values replaced where the recipe gives them: (flag, value) -> (new value, why).
CPU_SET_VALUES = {
    ("--moe-token-dispatcher-type", "flex"): (
        "alltoall",
        "flex is an all-to-all on DeepEP / HybridEP CUDA kernels; Megatron's own all-to-all",
    ),
}
#: From the project's CPU flag set (harness.MEGATRON_CPU) these are not CPU matters and stay
#: the recipe's: the micro-batch size, the attention dropout and the vocabulary.
NOT_CPU = ("--micro-batch-size", "--attention-dropout", "--vocab-size")

#: Path flags -> the tests' files ("data", "tokenizer", "vocab", "merges", "run/<name>").
PATHS = {
    "--data-path": "data",
    "--vocab-file": "vocab",
    "--merge-file": "merges",
    "--tokenizer-model": "tokenizer",
    "--save": "run/ckpt",
    "--load": "run/ckpt",
    "--tensorboard-dir": "run/tb",
    "--data-cache-path": "run/cache",
}
