"""Tokenizers: byte round trips, a locally trained BPE, loading errors, the factory."""

import json
import random

import pytest

from megatron_hdp.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    train_bpe,
)

SAMPLES = [
    "",
    "hello world",
    "def f(x):\n    return x ** 2\n",
    "naïve café, Ελληνικά, 日本語, emoji 🚀\ttab",
    "  leading and trailing spaces  ",
]


def generated_text(seed: int, num_docs: int = 200) -> list[str]:
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(80)
    ]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
        + rng.choice([".", "!", "\n"])
        for _ in range(num_docs)
    ]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_bpe(generated_text(0), vocab_size=300, path=path)


def test_byte_tokenizer_constants():
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eod) == ("ByteLevel", 257, 256)


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip_of_strings(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod]) == text
    assert tok.decode([tok.eod] + ids[:3] + [tok.eod] + ids[3:]) == text


def test_byte_encode_of_raw_bytes_is_the_bytes():
    data = bytes(range(256)) * 2
    tok = ByteTokenizer()
    assert tok.encode(data) == [b for b in data]
    assert tok.eod not in tok.encode(data)


def test_byte_decode_replaces_invalid_utf8_and_rejects_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="257"):
        tok.decode([1, 257])
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_trained_bpe_has_requested_vocab_and_eod(bpe, tmp_path):
    assert bpe.name == "HuggingFaceTokenizer"
    assert bpe.vocab_size == 300
    spec = json.loads(bpe.path.read_text(encoding="utf-8"))
    (added,) = [t for t in spec["added_tokens"] if t["content"] == "<|endoftext|>"]
    assert bpe.eod == added["id"]
    assert spec["pre_tokenizer"]["type"] == "ByteLevel"
    assert spec["decoder"]["type"] == "ByteLevel"
    assert len(spec["model"]["vocab"]) == 300
    # only the tokenizer itself in its folder: the temporary file was renamed away
    assert sorted(p.name for p in bpe.path.parent.iterdir()) == ["tokenizer.json"]


@pytest.mark.parametrize("text", SAMPLES + generated_text(1, num_docs=5))
def test_trained_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.eod not in ids
    assert bpe.decode(ids) == text
    assert bpe.decode(ids + [bpe.eod]) == text
    assert bpe.encode(text.encode("utf-8")) == ids


def test_trained_bpe_compresses_text_like_its_training_data(bpe):
    text = " ".join(generated_text(0)[:20])
    assert len(bpe.encode(text)) < 0.7 * len(text.encode("utf-8"))


def test_trained_bpe_loads_again_identically(bpe):
    again = HFTokenizer(bpe.path)
    text = generated_text(2, num_docs=1)[0]
    assert again.encode(text) == bpe.encode(text)
    assert (again.vocab_size, again.eod) == (bpe.vocab_size, bpe.eod)


def test_train_bpe_overwrites_existing_file(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text("old")
    tok = train_bpe(generated_text(3), vocab_size=270, path=path)
    assert tok.vocab_size == 270
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]


@pytest.mark.parametrize("vocab_size", [0, 256, 257])
def test_train_bpe_rejects_small_vocab(tmp_path, vocab_size):
    with pytest.raises(ValueError, match="258"):
        train_bpe(["some text"], vocab_size=vocab_size, path=tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("texts", [[], ["", ""]])
def test_train_bpe_rejects_no_text(tmp_path, texts):
    with pytest.raises(ValueError, match="no text"):
        train_bpe(iter(texts), vocab_size=300, path=tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


def test_hf_tokenizer_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json"):
        HFTokenizer(path)


@pytest.mark.parametrize("content", ["not json at all", "{}", '{"model": 3}'])
def test_hf_tokenizer_invalid_file_names_it(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.json"):
        HFTokenizer(path)


def test_hf_tokenizer_without_eod_names_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        generated_text(4), trainer=trainers.BpeTrainer(vocab_size=280, show_progress=False)
    )
    path = tmp_path / "no_eod.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match=r"no_eod\.json.*<\|endoftext\|>"):
        HFTokenizer(path)


def test_build_tokenizer(bpe):
    assert isinstance(build_tokenizer("ByteLevel"), ByteTokenizer)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe.path))
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == 300
    with pytest.raises(ValueError, match="tokenizer model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match=r"'GPT2BPETokenizer'.*ByteLevel.*HuggingFaceTokenizer"):
        build_tokenizer("GPT2BPETokenizer")
