"""A rank's CPU memory for data (USS) with a JSONL source: <= 1/10 with the data service.

Issue 46's measure, run small: `scripts/bench/bench_rank_data_memory.py` opens a 1 MB JSONL
source (tokenized on open) in a fresh process, first as a rank of the Ray data service
(lengths only), then as a rank of the in-process loader, and measures the process's USS
growth each time. The
in-process figure is checked against the tokens it must hold (an independent floor).
"""

import importlib.util
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")  # Ray's own dependency: installed with the extras

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_rank_data_memory.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_rank_data_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_data_service_rank_holds_under_a_tenth_of_an_in_process_ranks_data(tmp_path):
    bench = _bench()
    bench.write_jsonl(tmp_path / "web.jsonl", 1.0)
    from megatron_hdp.data.sources import lengths_index
    from megatron_hdp.data.tokenizers import build_tokenizer

    index = lengths_index(
        [str(tmp_path / "web.jsonl")], json_key="text", tokenizer=build_tokenizer("ByteLevel"),
        cache_dir=tmp_path,
    )  # fmt: skip
    tokens = int(index["lengths"].sum())
    lean, full = bench.run_modes(tmp_path, [("on_open", True), ("on_open", False)])
    assert full["tokens"] == lean["tokens"] == tokens
    assert full["data_bytes"] >= 4 * tokens  # the tokens, held (at least 4 bytes each)
    assert lean["data_bytes"] <= full["data_bytes"] / 10, (lean, full)
