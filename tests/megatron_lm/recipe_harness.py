"""NVIDIA's launch setups (`recipes/*.args`) shrunk for CPU ranks by the rules of
`recipes/rules.py`, and the files they read (data, tokenizers) made here, offline.

`load(name)` reads a checked-in flag list; `shrink(name, argv, files, run, ranks=...)`
applies the rules and returns the argument list of one run: the multi-rank layout
(`rules.LAYOUTS`) or the 1-rank reference (every parallel size 1). `recipe_files(folder,
tag)` writes the data and tokenizer files each tokenizer kind needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.megatron_lm.harness import MEGATRON_CPU, megatron_vocab_size
from tests.megatron_lm.recipes import rules

RECIPES = Path(__file__).resolve().parent / "recipes"


def file_name(name: str) -> str:
    """`G175'` -> `G175_v019.args` (as scripts/megatron_lm_recipes.py names them)."""
    return name.replace("'", "_v019") + ".args"


def header(name: str) -> dict[str, str]:
    """The `# key: value` lines of a flag list's header."""
    out = {}
    for line in (RECIPES / file_name(name)).read_text().splitlines():
        if line.startswith("# ") and ": " in line:
            key, value = line[2:].split(": ", 1)
            out.setdefault(key, value)
    return out


def environment(name: str) -> dict[str, str | None]:
    """The environment the setup's file sets (`# env:`; None: the file unsets it).

    `${X:-v}` is v; values naming other variables (W&B keys, SLURM paths) are left out.
    """
    out: dict[str, str | None] = {}
    for item in header(name)["env"].split():
        if item == "(none)":
            continue
        if item.startswith("-"):
            out[item[1:]] = None
            continue
        key, value = item.split("=", 1)
        if value.startswith("${") and ":-" in value and value.endswith("}"):
            value = value[value.index(":-") + 2 : -1]
        if "$" not in value:
            out[key] = value
    return out


def load(name: str) -> list[str]:
    """The arguments of setup `name` as NVIDIA's file gives them (header skipped)."""
    text = (RECIPES / file_name(name)).read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def groups(argv: list[str]) -> list[list]:
    """[[flag, [values]], ...]: a value is every following word not starting with `--`."""
    out: list[list] = []
    for word in argv:
        if word.startswith("--"):
            out.append([word, []])
        else:
            assert out, f"a value before any flag: {word!r}"
            out[-1][1].append(word)
    return out


def flatten(grouped: list[list]) -> list[str]:
    """The argument list of `groups` output."""
    return [word for flag, values in grouped for word in (flag, *values)]


def _get(grouped, flag):
    return next((values for f, values in grouped if f == flag), None)


def _set(grouped, flag, values, add=False):
    for item in grouped:
        if item[0] == flag:
            item[1] = list(values)
            return
    if add:
        grouped.append([flag, list(values)])


def _drop(grouped, flag):
    grouped[:] = [item for item in grouped if item[0] != flag]


def stock_fixed(name: str, argv: list[str], tag: str | None = None) -> list[str]:
    """`argv` with the minimal fix of rules.STOCK_FIXES (none for most setups) for the
    Megatron-LM tree `tag` (rules.STOCK_FIX_ONLY_AT; None: every fix)."""
    grouped = groups(argv)
    only = rules.STOCK_FIX_ONLY_AT.get(name)
    fixes = [] if tag is not None and only not in (None, tag) else rules.STOCK_FIXES.get(name, [])
    for op, flag, values in fixes:
        have = _get(grouped, flag)
        assert have is not None, f"{name}: the stock fix names {flag}, which it does not pass"
        if op == "set":
            _set(grouped, flag, values)
        elif op == "drop":
            _drop(grouped, flag)
        elif op == "join":
            _set(grouped, flag, [" ".join(have)])
        elif op == "split":
            _set(grouped, flag, " ".join(have).split())
        elif op == "to_samples":
            batch = int(_get(grouped, "--global-batch-size")[0])
            for item in grouped:
                if item[0] == flag:
                    item[0], item[1] = values[0], [str(int(have[0]) * batch)]
        else:
            raise ValueError(op)
    return flatten(grouped)


def cpu_flags() -> list[str]:
    """The project's CPU flag set (harness.MEGATRON_CPU) without rules.NOT_CPU."""
    return flatten([g for g in groups(MEGATRON_CPU) if g[0] not in rules.NOT_CPU])


def shrink(
    name: str,
    argv: list[str],
    files: dict,
    run: Path,
    *,
    one_rank: bool,
    resize: bool = True,
    tag: str | None = None,
) -> list[str]:
    """The arguments of one CPU run of setup `name` (stock fix, sizes, layout, CPU, paths).

    `files` is `recipe_files`' output, `run` this run's own folder (checkpoints, logs);
    `one_rank`: the 1-rank reference (TP = PP = CP = EP = 1) instead of rules.LAYOUTS.
    `resize=False` keeps the recipe's sizes and layout (only the CPU swaps and paths);
    `tag`: the Megatron-LM tree (for the stock fixes). `--hdp` is not added here.
    """
    grouped = groups(stock_fixed(name, argv, tag))
    if resize:
        _resize(name, grouped, one_rank)
    return _cpu_and_paths(grouped, files, run)


def _resize(name, grouped, one_rank):
    sizes = {**rules.SIZES, **rules.SIZE_OVERRIDES.get(name, {})}
    for item in grouped:
        new = sizes.get(item[0])
        if new is not None:
            item[1] = new(item[1]) if callable(new) else list(new)
    layout = {} if one_rank else rules.LAYOUTS[name]
    tp = rules.LAYOUTS[name].get("tp", 1)
    if one_rank and tp > 1:  # the multi-rank run's padded vocabulary (rules.VOCAB_DIVISOR_*)
        divisor = int((_get(grouped, "--make-vocab-size-divisible-by") or [0])[0])
        divisor = divisor or rules.VOCAB_DIVISOR_DEFAULT
        _set(grouped, "--make-vocab-size-divisible-by", [str(divisor * tp)], add=True)
    for key, flag in rules.LAYOUT_FLAGS.items():
        _set(grouped, flag, [str(layout.get(key, 1))])
    if one_rank:
        for flag in rules.ONE_RANK_DROP:
            _drop(grouped, flag)
    for flag, make in rules.LAYOUT_SIZES.items():
        if _get(grouped, flag) is not None:
            values = make(layout.get("cp", 1))
            if values:
                _set(grouped, flag, values)
            else:
                _drop(grouped, flag)


def _cpu_and_paths(grouped, files, run):
    for flag, values in rules.CPU_SET.items():
        _set(grouped, flag, values, add=flag == "--transformer-impl")
    for flag in rules.CPU_DROP:
        _drop(grouped, flag)
    for (flag, value), (new, _) in rules.CPU_SET_VALUES.items():
        if _get(grouped, flag) == [value]:
            _set(grouped, flag, [new])
    for flag, value in rules.CPU_DROP_VALUES:
        values = _get(grouped, flag)
        if values is not None and value in values:
            kept = [v for v in values if v != value]
            _set(grouped, flag, kept) if kept else _drop(grouped, flag)
    grouped += [g for g in groups(cpu_flags()) if _get(grouped, g[0]) is None]
    kind = tokenizer_kind(flatten(grouped))
    for flag, where in rules.PATHS.items():
        if _get(grouped, flag) is None:
            continue
        if where.startswith("run/"):
            _set(grouped, flag, [str(run / where[4:])])
        elif where == "data":
            _set(grouped, flag, [files[kind]["data"]])
        else:
            _set(grouped, flag, [files[kind][where]])
    if _get(grouped, "--vocab-size") is not None:
        _set(grouped, "--vocab-size", [str(files[kind]["vocab_size_flag"])])
    return flatten(grouped)


def tokenizer_kind(argv: list[str]) -> str:
    """Which tokenizer files a flag list reads: null, gpt2, hf or spm."""
    grouped = groups(argv)
    kind = (_get(grouped, "--tokenizer-type") or ["GPT2BPETokenizer"])[0]
    return {
        "NullTokenizer": "null",
        "GPT2BPETokenizer": "gpt2",
        "HuggingFaceTokenizer": "hf",
        "Llama2Tokenizer": "spm",
        "GPTSentencePieceTokenizer": "spm",
        "SentencePieceTokenizer": "spm",
    }[kind]


def _write_docs(prefix: Path, vocab: int, eod: int) -> None:
    """200 documents of 20 to 700 token ids below min(vocab, 256) (not eod), then eod."""
    from megatron_hdp.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    ids = [i for i in range(min(vocab, 256)) if i != eod]
    docs = [[*rng.choice(ids, size=int(n)).tolist(), eod] for n in rng.integers(20, 700, size=200)]
    write_indexed_dataset(prefix, docs, vocab_size=vocab)


def recipe_files(folder: Path) -> dict:
    """Per tokenizer kind: the tokenizer files, indexed documents in its ids, and the
    `--vocab-size` value. Offline: small tokenizers trained here on generated text.

    null: NullTokenizer (ids 0..255, end-of-document 256); gpt2: GPT-2 BPE vocab.json +
    merges.txt with <|endoftext|> (also as the hub model 'gpt2' in a local hub cache, which
    megatron-core 0.19 builds GPT2BPETokenizer from); hf: a Hugging Face folder with Llama-3's
    <|end_of_text|>; spm: a SentencePiece model (Llama2Tokenizer, GPTSentencePieceTokenizer).
    """
    import sentencepiece
    import transformers

    from tests.megatron_lm.test_tokenizers import _byte_bpe, _hub_cache, _texts

    files: dict = {}
    texts = _texts()
    null = folder / "null"
    null.mkdir()
    _write_docs(null / "docs", 257, 256)
    files["null"] = {"data": str(null / "docs"), "vocab_size_flag": megatron_vocab_size()}
    # GPT-2 BPE
    gpt2 = folder / "gpt2"
    gpt2.mkdir()
    _byte_bpe(texts, ["<|endoftext|>"]).model.save(str(gpt2))
    vocab = json.loads((gpt2 / "vocab.json").read_text())
    (gpt2 / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    hub = _hub_cache(gpt2, folder / "hub", "gpt2")
    _write_docs(gpt2 / "docs", len(vocab), vocab["<|endoftext|>"])
    files["gpt2"] = {
        "data": str(gpt2 / "docs"),
        "vocab": str(gpt2 / "vocab.json"),
        "merges": str(gpt2 / "merges.txt"),
        "vocab_size_flag": len(vocab),
    }
    # a Hugging Face folder as Llama-3's
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_bpe(texts, special), bos_token=special[0], eos_token=special[1]
    )
    fast.save_pretrained(str(folder / "hf"))
    _write_docs(folder / "hf_docs", len(fast), fast.eos_token_id)
    files["hf"] = {
        "data": str(folder / "hf_docs"),
        "tokenizer": str(folder / "hf"),
        "vocab_size_flag": len(fast),
    }
    # SentencePiece
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(folder / "spm"),
        vocab_size=80,
        model_type="bpe",
        minloglevel=2,
    )
    model = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    _write_docs(folder / "spm_docs", model.get_piece_size(), model.eos_id())
    files["spm"] = {
        "data": str(folder / "spm_docs"),
        "tokenizer": str(folder / "spm.model"),
        "vocab_size_flag": model.get_piece_size(),
    }
    files["hub"] = hub
    return files
