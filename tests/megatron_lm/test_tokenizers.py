"""Every tokenizer Megatron-LM builds, read by the drop-in's data layer through that object.

Tiny tokenizer files are made here, offline: a Hugging Face folder with Llama-3's
end-of-text token (`<|end_of_text|>`, no `<|endoftext|>`), also laid out as a local hub
cache (`--tokenizer-model local/tiny`), GPT-2 BPE vocab/merges files,
a SentencePiece model, and a tiktoken vocabulary in the JSON format Megatron-LM's
TikTokenizer reads. For each `--tokenizer-type`, the drop-in's data layer (a JSONL data
spec, tokenized when opened) holds `tokenize(text) + [eod]` of Megatron-LM's own tokenizer
object for every document, with its vocabulary; two of them also train through
`pretrain_gpt.py --hdp` on 2 ranks with the losses of a 1-rank run.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

BASE = [*SHARED, *MEGATRON_CPU, "--train-iters", "2", "--eval-interval", "10"]
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which "
    "river stone bright seven quietly garden number window yellow running music paper"
).split()


def _texts(n: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 60)))) for _ in range(n)]


def _byte_bpe(texts, special: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _tiktoken_vocab(texts) -> list[dict]:
    """Megatron-LM's TikTokenizer JSON: the 256 bytes, then every prefix of the words."""
    tokens = [bytes([i]) for i in range(256)]
    for word in WORDS:
        for end in range(2, len(word) + 1):
            for piece in (word[:end].encode(), (" " + word)[: end + 1].encode()):
                if piece not in tokens:
                    tokens.append(piece)
    return [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for i, t in enumerate(tokens)
    ]


def _hub_cache(source, cache, repo_id="local/tiny"):
    """`source` as the local hub cache holds a downloaded repo `repo_id` (offline use)."""
    import shutil

    revision = "0" * 40
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    missing = repo / ".no_exist" / revision  # what the hub said it does not have
    missing.mkdir(parents=True)
    probed = ("config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
    probed += ("merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
    for name in probed:
        if not (snapshot / name).exists():
            (missing / name).write_text("")
    return cache


def _use_local_hub(corpus, monkeypatch) -> None:
    """Hugging Face reads hub repos from the corpus's local cache, offline.

    The hub id case, and GPT2BPETokenizer from megatron-core 0.19 on, which Megatron-LM
    builds as the hub model "gpt2" with the given vocabulary and merges.
    """
    if "hub" not in corpus:
        return  # no transformers: nothing reads the hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(corpus["hub"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The texts (a JSONL data spec) and the tokenizer files, made once for the module."""
    folder = tmp_path_factory.mktemp("tokenizers")
    texts = _texts()
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"sources": [{"name": "docs", "jsonl": str(jsonl)}]}))
    files = {"texts": texts, "spec": str(spec)}
    # NullTokenizer reads text as space-separated ids
    rng = np.random.default_rng(1)
    numbers = [
        " ".join(map(str, rng.integers(0, 256, size=int(rng.integers(5, 50))))) for _ in texts
    ]
    null = folder / "null.jsonl"
    null.write_text("".join(json.dumps({"text": t}) + "\n" for t in numbers))
    null_spec = folder / "null_spec.json"
    null_spec.write_text(json.dumps({"sources": [{"name": "docs", "jsonl": str(null)}]}))
    files["null"] = {"texts": numbers, "spec": str(null_spec)}
    # GPT-2 BPE: vocab.json + merges.txt with <|endoftext|>
    gpt2 = folder / "gpt2"
    gpt2.mkdir()
    _byte_bpe(texts, ["<|endoftext|>"]).model.save(str(gpt2))
    files["gpt2"] = gpt2
    # tiktoken (Megatron-LM's JSON vocabulary)
    tik = folder / "tiktoken.json"
    vocab = _tiktoken_vocab(texts)
    tik.write_text(json.dumps(vocab))
    files["tiktoken"], files["tiktoken_size"] = tik, len(vocab)
    try:
        import transformers
    except ImportError:
        pass
    else:  # a Hugging Face folder as Llama-3's: <|begin_of_text|>, <|end_of_text|>
        special = ["<|begin_of_text|>", "<|end_of_text|>"]
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=_byte_bpe(texts, special),
            bos_token=special[0],
            eos_token=special[1],
        )
        fast.save_pretrained(str(folder / "hf"))
        files["hf"] = folder / "hf"
        files["hub"] = _hub_cache(folder / "hf", folder / "hub")
        # megatron-core >= 0.19 builds GPT2BPETokenizer as the hub model "gpt2" with the
        # given vocab and merges: the same tiny files, as that repo, in the local cache
        config = {"tokenizer_class": "GPT2Tokenizer"}
        (gpt2 / "tokenizer_config.json").write_text(json.dumps(config))
        (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        _hub_cache(gpt2, folder / "hub", "gpt2")
    try:
        import sentencepiece
    except ImportError:
        pass
    else:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(folder / "spm"),
            vocab_size=80,
            model_type="bpe",
            minloglevel=2,
        )
        files["spm"] = folder / "spm.model"
    return files


def _parse_and_validate(monkeypatch, argv):
    from megatron.training import arguments

    from megatron_hdp.megatron_lm.hooks import _checked_validate_args, with_hdp_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(with_hdp_args(None))
    _checked_validate_args(arguments.validate_args)(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


def _flags(corpus, kind: str) -> list[str]:
    """The tokenizer flags of each `--tokenizer-type` for the files of `corpus`."""
    if kind == "GPT2BPETokenizer":
        gpt2 = corpus["gpt2"]
        return ["--vocab-file", str(gpt2 / "vocab.json"), "--merge-file", str(gpt2 / "merges.txt")]
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-model", str(corpus["hf"])]
    if kind == "HuggingFaceTokenizer-hub":  # a hub id, from the local hub cache
        return ["--tokenizer-model", "local/tiny"]
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return ["--tokenizer-model", str(corpus["spm"])]
    if kind == "TikTokenizer":
        # 8 special tokens: megatron-core 0.19's TikTokenizer has 7 of its own
        size = corpus["tiktoken_size"] + 8
        return [
            *["--tokenizer-model", str(corpus["tiktoken"]), "--tiktoken-pattern", "v2"],
            *["--tiktoken-num-special-tokens", "8", "--vocab-size", str(size)],
        ]
    return []  # NullTokenizer: SHARED's


NEEDS = {
    "HuggingFaceTokenizer": "transformers",
    "HuggingFaceTokenizer-hub": "transformers",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}
TYPES = ["NullTokenizer", "GPT2BPETokenizer", *NEEDS]


@pytest.mark.parametrize("kind", TYPES)
def test_the_data_layer_reads_with_megatron_lms_own_tokenizer(trees, corpus, monkeypatch, kind):
    """Same token ids, end-of-document token and vocabulary as Megatron-LM's object."""
    if kind in NEEDS:
        pytest.importorskip(NEEDS[kind])
    from megatron.training import global_vars

    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.megatron_lm.args import global_batch
    from megatron_hdp.megatron_lm.data import megatron_lm_data_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts, spec = corpus["texts"], corpus["spec"]
    if kind == "NullTokenizer":
        texts, spec = corpus["null"]["texts"], corpus["null"]["spec"]
    if kind.endswith("-hub") or kind == "GPT2BPETokenizer":
        _use_local_hub(corpus, monkeypatch)
    argv = [*BASE, "--hdp", "--hdp-data-spec", spec, "--tokenizer-type", kind.split("-")[0]]
    args = _parse_and_validate(monkeypatch, [*argv, *_flags(corpus, kind)])
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", None)
    tokenizer = global_vars._build_tokenizer(args)  # as Megatron-LM's start-up does
    data = build_training_data(megatron_lm_data_config(args, *global_batch(args)))
    assert data.vocab_size == tokenizer.vocab_size
    reader = data.datasets[0]
    assert len(reader) == len(texts)
    for k, text in enumerate(texts):
        want = [*tokenizer.tokenize(text), tokenizer.eod]
        assert reader.get(k).tolist() == want, (kind, k)
    if kind.startswith("HuggingFaceTokenizer"):  # Llama-3's end of text, not <|endoftext|>
        import transformers

        folder = transformers.AutoTokenizer.from_pretrained(str(corpus["hf"]))
        assert tokenizer.eod == folder.convert_tokens_to_ids("<|end_of_text|>")
        assert "<|endoftext|>" not in folder.get_vocab()
    if kind != "NullTokenizer":  # a real tokenizer: several ids per document
        assert sum(len(reader.get(k)) for k in range(len(reader))) > 2 * len(reader)


@pytest.mark.parametrize(
    "kind, flag",
    [
        ("SFTTokenizer", "--tokenizer-type SFTTokenizer"),
        ("MultimodalTokenizer", "--tokenizer-type MultimodalTokenizer"),
        ("hf-file", "--tokenizer-model"),
    ],
)
def test_a_tokenizer_hdp_cannot_read_with_is_refused_at_start_up(
    trees, corpus, monkeypatch, capsys, kind, flag
):
    """Refused by name, one line, before any process group: never after the model is built."""
    if kind == "hf-file":
        if "hf" not in corpus:
            pytest.skip("needs transformers")
        extra = ["--tokenizer-type", "HuggingFaceTokenizer"]
        extra += ["--tokenizer-model", str(corpus["hf"] / "tokenizer.json")]
    else:
        extra = ["--tokenizer-type", kind]
    with pytest.raises(SystemExit) as stop:
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *extra])
    assert stop.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("pretrain_gpt.py: error: ") and flag in message, message


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_pretrain_gpt_trains_with_the_tokenizer(trees, corpus, monkeypatch, kind):
    """`pretrain_gpt.py --hdp` on 2 ranks over JSONL text tokenized by Megatron-LM's
    tokenizer: finite losses, equal to a 1-rank run's."""
    if kind in NEEDS:
        pytest.importorskip(NEEDS[kind])
    _, patched = trees
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _use_local_hub(corpus, monkeypatch)  # forked ranks inherit it
    flags = [*SHARED, *MEGATRON_CPU, "--hdp", "--hdp-data-spec", corpus["spec"]]
    flags += ["--tokenizer-type", kind, *_flags(corpus, kind), "--train-iters", "2"]
    flags += ["--global-batch-size", "6", "--hdp-capacity", "512"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000", "--split", "100,0,0"]
    two = run_megatron_lm(patched / "pretrain_gpt.py", 2, flags)["train"]
    one = run_megatron_lm(patched / "pretrain_gpt.py", 1, flags)["train"]
    assert [i for i, _, _ in two] == [1, 2]
    assert all(np.isfinite(loss) for _, loss, _ in two)
    assert [r[1] for r in two] == pytest.approx([r[1] for r in one], rel=1e-5)
