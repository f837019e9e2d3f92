"""pretrain_hdp.py refuses a `.bin` that is not the pair of its `.idx`, before any training."""

import os

import pytest
import torch.distributed as dist

from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.tokenizers import ByteTokenizer
from tests.e2e.harness import SMALL_MODEL

TEXTS = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 7) for i in range(80)]


def token_documents(texts):
    tok = ByteTokenizer()
    return [tok.encode(text) + [tok.eod] for text in texts]


def train_args(prefix):
    return [
        *SMALL_MODEL,
        "--seq-length",
        "256",
        "--hdp-capacity",
        "128",
        "--train-iters",
        "1",
        "--lr",
        "3e-3",
        "--data-path",
        str(prefix),
        "--split",
        "100,0,0",
    ]


@pytest.mark.parametrize(
    ("bin_vocab", "bin_texts", "cause"),
    [
        # the same tokens as int32: Megatron would read every token as two uint16 ids
        pytest.param(100_000, TEXTS, "4-byte (int32) tokens", id="another-dtype"),
        pytest.param(257, [*TEXTS, "one more document\n"], "more data", id="more-documents"),
    ],
)
def test_bin_that_does_not_match_its_index_is_refused(
    tmp_path, monkeypatch, capsys, bin_vocab, bin_texts, cause
):
    import pretrain_hdp

    write_indexed_dataset(tmp_path / "index_of", token_documents(TEXTS), vocab_size=257)
    write_indexed_dataset(tmp_path / "data_of", token_documents(bin_texts), vocab_size=bin_vocab)
    os.replace(tmp_path / "index_of.idx", tmp_path / "mixed.idx")
    os.replace(tmp_path / "data_of.bin", tmp_path / "mixed.bin")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(train_args(tmp_path / "mixed"))
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    for needle in ("mixed.bin", "mixed.idx", "uint16 tokens", cause, "not a pair"):
        assert needle in err
    assert not dist.is_initialized()
