"""Regenerate the checked-in flag lists of NVIDIA's 17 Megatron-LM launch setups.

    python scripts/megatron_lm_recipes.py GIT_DIR [--out tests/megatron_lm/recipes]

GIT_DIR is a clone (or bare git directory) of NVIDIA/Megatron-LM holding the tags
core_v0.16.1 (commit 55ac708) and core_v0.19.0 (commit 5be9626). For each setup of
`SETUPS` it writes `OUT/<name>.args`: a `#` header naming the file, tag and commit, how the
list was expanded and the launch line, then the argument list `pretrain_gpt.py` receives,
one argument per line, exactly as NVIDIA's file gives it:

- shell recipes (`examples/`): bash runs the script in an empty folder holding a
  `pretrain_gpt.py`, with `torchrun`, `python` and `uv` replaced by functions that print
  their arguments, so quoting and word splitting are bash's own (the Llama-3 recipes'
  `"--split '99,1,0'"` keeps its quotes, as in production). Paths the user passes are the
  placeholders `${CHECKPOINT_PATH}` and so on; the folder the script runs in is written as
  `${PWD}`.
- CI configurations (`tests/functional_tests/.../model_config.yaml`): the MODEL_ARGS turned
  into arguments as Megatron-LM's CI does (`tests/functional_tests/shell_test_utils/
  _run_training.sh`): `true` gives a bare flag, a value in `[...]` is split on blanks, any
  other value with a blank stays one argument; `${VAR}` placeholders stay as written.

Where stock Megatron-LM itself refuses a setup, the minimal fix that the tests apply to both
of their runs (`tests/megatron_lm/recipes/rules.py`, STOCK_FIXES) is named in the header.
Needs bash and PyYAML; reads the files with `git show TAG:PATH`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COMMITS = {
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}
CI = "tests/functional_tests/test_cases/gpt"

#: name -> (tag, file, what, positional arguments of a shell recipe / None for a CI config,
#: environment for the expansion, stock fix text (None: stock accepts it)).
SETUPS = {
    "G175": (
        "core_v0.16.1",
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        "GPT-3 175B, TP8 PP16, fp16, GPT-2 BPE, batch-size rampup",
        [
            "${CHECKPOINT_PATH}",
            "${TENSORBOARD_LOGS_PATH}",
            "${VOCAB_FILE}",
            "${MERGE_FILE}",
            "${DATA_PATH}",
        ],
        {},
        "stock core_v0.16.1 refuses --rampup-batch-size with --train-iters ('expected no "
        "batch-size rampup for iteration-based training'): --train-iters N and "
        "--lr-decay-iters M become --train-samples N x B and --lr-decay-samples M x B "
        "(B = --global-batch-size). At core_v0.16.1 only: core_v0.19.0 accepts the list "
        "(--rampup-batch-size is deprecated there; Megatron-Core ignores it with a warning)",
    ),
    "G175'": (
        "core_v0.19.0",
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        "GPT-3 175B, TP8 PP16, fp16, GPT-2 BPE, step batch-size schedule",
        [
            "${CHECKPOINT_PATH}",
            "${TENSORBOARD_LOGS_PATH}",
            "${VOCAB_FILE}",
            "${MERGE_FILE}",
            "${DATA_PATH}",
        ],
        {},
        "stock core_v0.19.0 refuses it twice: the script expands TRAINING_ARGS unquoted, so "
        "the schedule reaches pretrain_gpt.py as six words (argparse: unrecognized "
        "arguments), and --step-batch-size-schedule with --global-batch-size ('Cannot "
        "specify both'): the six words become one argument and --global-batch-size is dropped",
    ),
    "L8": (
        "core_v0.16.1",
        "examples/llama/train_llama3_8b_h100_fp8.sh",
        "Llama-3 8B, FP8 hybrid, distributed optimizer with both overlaps, HF tokenizer, "
        "sample-based schedule (real-data branch: tokenizer and data given)",
        ["${CHECKPOINT_PATH}", "${TENSORBOARD_LOGS_PATH}", "${TOKENIZER_MODEL}", "${DATA_PATH}"],
        {},
        None,
    ),
    "L8'": (
        "core_v0.19.0",
        "examples/llama/train_llama3_8b_h100_fp8.sh",
        "Llama-3 8B as L8, with RMSNorm (real-data branch)",
        ["${CHECKPOINT_PATH}", "${TENSORBOARD_LOGS_PATH}", "${TOKENIZER_MODEL}", "${DATA_PATH}"],
        {},
        None,
    ),
    "L8m": (
        "core_v0.16.1",
        "examples/llama/train_llama3_8b_h100_fp8.sh",
        "Llama-3 8B as L8, the script's default MOCK branch (--mock-data, NullTokenizer)",
        [],
        {},
        None,
    ),
    "MX": (
        "core_v0.16.1",
        "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        "Mixtral 8x7B, PP4 EP8, Llama2Tokenizer",
        ["${CHECKPOINT_PATH}", "${TOKENIZER_MODEL}", "${DATA_PATH}"],
        {},
        None,
    ),
    "LF'": (
        "core_v0.19.0",
        "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
        "Llama-3 8B, Megatron-FSDP, FP8 (real-data branch)",
        ["${CHECKPOINT_PATH}", "${DATA_PATH}", "${TOKENIZER_MODEL}"],
        {},
        None,
    ),
    "OSS'": (
        "core_v0.19.0",
        "examples/gptoss/02_train.sh",
        "gpt-oss: MoE, sliding window, learnable softmax, FP8 (real-data branch)",
        [
            "--checkpoint-path",
            "${CHECKPOINT_PATH}",
            "--tokenizer",
            "${TOKENIZER_MODEL}",
            "--data",
            "${DATA_PATH}",
        ],
        {},
        "the script sets --pipeline-model-parallel-size to the world size, 8, for 12 layers, "
        "which stock Megatron-LM refuses (layers not divisible by stages): "
        "--pipeline-model-parallel-size 4",
    ),
    "DS'": (
        "core_v0.19.0",
        "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
        "DeepSeek-V3: MoE, MLA, MTP, Megatron-FSDP (PRETRAIN_ARGS with the script's defaults)",
        [],
        {},
        None,
    ),
    "R15": (
        "core_v0.16.1",
        f"{CI}/gpt3_15b_8t_release/model_config.yaml",
        "15B release run: TP8 + SP, rampup, SentencePiece, rotary-percent 0.5",
        None,
        {},
        None,
    ),
    "CKA": (
        "core_v0.16.1",
        f"{CI}/gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer/model_config.yaml",
        "--async-save, distributed optimizer, checkpoint resume",
        None,
        {},
        None,
    ),
    "RC": (
        "core_v0.16.1",
        f"{CI}/gpt3_mcore_te_tp1_pp1_uniform_full_recompute/model_config.yaml",
        "full/uniform activation recompute",
        None,
        {},
        None,
    ),
    "CP4": (
        "core_v0.16.1",
        f"{CI}/gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic/model_config.yaml",
        "PP2 x CP4, --cp-comm-type a2a+p2p, hierarchical CP 2 x 2",
        None,
        {},
        "Megatron-LM's CI passes a value with a blank as one argument, so "
        "--hierarchical-context-parallel-sizes gets '2 2', which stock argparse refuses "
        "(invalid int value): the value is split into 2 2",
    ),
    "VP": (
        "core_v0.16.1",
        f"{CI}/gpt3_mcore_te_tp1_pp4_vp1/model_config.yaml",
        "PP4 with interleaved (virtual) pipeline stages",
        None,
        {},
        None,
    ),
    "CP2": (
        "core_v0.16.1",
        f"{CI}/gpt3_mcore_te_tp2_pp2_cp2_calculate_per_token_loss/model_config.yaml",
        "TP2 PP2 CP2 + SP, per-token loss",
        None,
        {},
        None,
    ),
    "TPO": (
        "core_v0.16.1",
        f"{CI}/gpt3_weekly_dgx_h100_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap"
        "/model_config.yaml",
        "H100 weekly: TP2 PP2 + SP, FP8 tensorwise, --tp-comm-overlap",
        None,
        {},
        None,
    ),
    "CPF8": (
        "core_v0.16.1",
        f"{CI}/gpt3_weekly_dgx_h100_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap"
        "/model_config.yaml",
        "H100 weekly: TP4 x CP2 + SP, FP8 tensorwise",
        None,
        {},
        None,
    ),
}

STUBS = r"""
torchrun() { printf 'LAUNCH torchrun'; printf ' %q' "$@"; printf '\n'; printf '%s\n' "$@"; }
python() { printf 'LAUNCH python'; printf ' %q' "$@"; printf '\n'; printf '%s\n' "$@"; }
uv() { if [ "$1" = run ]; then shift; fi; "$@"; }
export -f torchrun python uv
"""


def file_name(name: str) -> str:
    """`G175'` -> `G175_v019.args` (a prime marks a setup taken at core_v0.19.0)."""
    return name.replace("'", "_v019") + ".args"


def git_show(git_dir: Path, tag: str, path: str) -> str:
    """The file at `tag` (checked against the commit the recipes were read at)."""
    commit = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", f"{tag}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if commit != COMMITS[tag]:
        sys.exit(f"{tag} is {commit} in {git_dir}, expected {COMMITS[tag]}")
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"{tag}:{path}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def expand_shell(text: str, positional: list[str], name: str) -> tuple[list[str], str]:
    """(arguments after pretrain_gpt.py, launch line) of a shell recipe, as bash runs it."""
    if name == "DS'":  # an sbatch script: print PRETRAIN_ARGS where it would submit the job
        marker = "# SLURM settings"
        assert marker in text, "the DeepSeek-V3 script changed"
        text = text.replace(marker, 'printf "%s\\n" "${PRETRAIN_ARGS[@]}"; exit 0\n' + marker)
    with tempfile.TemporaryDirectory() as folder:
        sandbox = Path(folder).resolve()
        (sandbox / "pretrain_gpt.py").write_text("")
        (sandbox / "recipe.sh").write_text(text)
        for arg in positional:  # gpt-oss checks that its checkpoint folder exists
            if arg == "${CHECKPOINT_PATH}":
                (sandbox / arg).mkdir(exist_ok=True)
        env = {"PATH": os.environ["PATH"], "HOME": str(sandbox), "PWD": str(sandbox)}
        out = subprocess.run(
            ["bash", "-c", STUBS + 'bash recipe.sh "$@"', "bash", *positional],
            cwd=sandbox, env=env, check=True, capture_output=True, text=True,
        ).stdout.replace(str(sandbox), "${PWD}")  # fmt: skip
    lines = out.splitlines()
    if name == "DS'":
        return lines, "python ${MEGATRON_PATH}/pretrain_gpt.py (srun, one process per GPU)"
    launch = next(line for line in lines if line.startswith("LAUNCH "))
    printed = lines[lines.index(launch) + 1 :]
    script = next(i for i, arg in enumerate(printed) if arg.endswith("pretrain_gpt.py"))
    words = shlex.split(launch[len("LAUNCH ") :])
    launcher = words[: next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1]
    return printed[script + 1 :], shlex.join(launcher)


def expand_ci(text: str) -> tuple[list[str], dict]:
    """MODEL_ARGS as Megatron-LM's CI turns them into arguments; and the ENV_VARS."""
    config = yaml.safe_load(text)
    argv: list[str] = []
    for key, value in config["MODEL_ARGS"].items():
        value = "true" if value is True else str(value).strip()
        if value == "true":
            argv.append(key)
        elif value.startswith("[") and value.endswith("]"):
            argv += [key, *value[1:-1].split()]
        else:  # a value with a blank stays one argument ("$key \"$value\"")
            argv += [key, value]
    return argv, {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()}


def shell_env(text: str) -> dict:
    """The environment variables a shell recipe exports (or unsets, as None)."""
    env = {}
    for line in text.splitlines():
        if line.startswith("export PYTHONPATH="):  # the DeepSeek-V3 job's own command line
            continue
        words = line.strip().split()
        if words[:1] == ["export"] and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
        elif words[:1] == ["unset"]:
            env[words[1]] = None
    return env


def write(out: Path, name: str, git_dir: Path) -> Path:
    """Write `out/<name>.args` for setup `name`."""
    tag, path, what, positional, _, fix = SETUPS[name]
    text = git_show(git_dir, tag, path)
    if positional is None:
        argv, env = expand_ci(text)
        how = (
            "MODEL_ARGS as Megatron-LM's CI (_run_training.sh) passes them: `true` a bare "
            "flag, [a b] split, another value with a blank one argument"
        )
        launch = "torchrun --nproc_per_node 8 pretrain_gpt.py (Megatron-LM's CI, 1 node)"
    else:
        argv, launch = expand_shell(text, positional, name)
        env = shell_env(text)
        how = (
            "bash ran the script with torchrun/python/uv printing their arguments; "
            f"script arguments: {shlex.join(positional) or '(none)'}"
        )
    header = [
        f"# {name}: {what}",
        f"# source: NVIDIA/Megatron-LM {path}",
        f"# tag: {tag} (commit {COMMITS[tag]})",
        f"# expanded: {how}",
        f"# launch: {launch}",
        "# env: " + (" ".join(f"{k}={v}" if v is not None else f"-{k}" for k, v in env.items())
                     or "(none)"),
        f"# stock-fix: {fix or 'none (stock Megatron-LM accepts the list)'}",
        "# regenerate: python scripts/megatron_lm_recipes.py GIT_DIR (do not edit by hand)",
    ]  # fmt: skip
    target = out / file_name(name)
    target.write_text("\n".join([*header, *argv]) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir", type=Path, help="a clone or bare git dir of Megatron-LM")
    parser.add_argument("--out", type=Path, default=REPO / "tests/megatron_lm/recipes")
    args = parser.parse_args(argv)
    git_dir = args.git_dir / ".git" if (args.git_dir / ".git").is_dir() else args.git_dir
    args.out.mkdir(parents=True, exist_ok=True)
    for name in SETUPS:
        print(write(args.out, name, git_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
