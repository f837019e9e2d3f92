"""Digests of a checkpoint's files: the ranks share the reading and miss nothing."""

from __future__ import annotations

import zlib

from megatron_hdp import checkpoint_digests as cd


def make_folder(tmp_path, count=7):
    for i in range(count):
        (tmp_path / f"__{i}_0.distcp").write_bytes(bytes([i]) * (1000 + i))
    (tmp_path / ".metadata").write_bytes(b"index")
    return cd.checkpoint_files(tmp_path)


def test_a_files_digest_is_its_size_and_the_crc32_of_every_byte(tmp_path):
    data = bytes(range(256)) * 40_000  # several read chunks
    (tmp_path / "f").write_bytes(data)
    assert cd.file_digest(tmp_path / "f") == {"bytes": len(data), "crc32": zlib.crc32(data)}


def test_the_shares_of_all_ranks_cover_every_file_once():
    names = [f"f{i}" for i in range(11)]
    for world in (1, 2, 3, 8, 16):
        shares = [cd.share(names, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(names)


def test_a_damaged_file_is_found_by_exactly_the_rank_whose_share_holds_it(tmp_path):
    names = make_folder(tmp_path)
    cd.write_digests(tmp_path, cd.digests(tmp_path, names), run_id="r", iteration=3)
    record = cd.read_digests(tmp_path)
    assert cd.digest_problems(tmp_path, record, run_id="r", iteration=3) == []
    victim = tmp_path / "__4_0.distcp"
    victim.write_bytes(bytes([9]) * victim.stat().st_size)  # same size, other bytes
    found = [
        cd.digest_problems(tmp_path, record, run_id="r", iteration=3, rank=r, world=3)
        for r in range(3)
    ]
    assert sum(bool(f) for f in found) == 1
    assert [p for f in found for p in f][0].startswith("__4_0.distcp does not hold the bytes")


def test_sizes_and_presence_are_checked_on_every_rank(tmp_path):
    names = make_folder(tmp_path)
    cd.write_digests(tmp_path, cd.digests(tmp_path, names), run_id=None, iteration=1)
    (tmp_path / "__2_0.distcp").unlink()
    record = cd.read_digests(tmp_path)
    for rank in range(4):
        problems = cd.digest_problems(tmp_path, record, rank=rank, world=4)
        assert "__2_0.distcp is missing" in problems


def test_a_record_of_another_run_is_named_first(tmp_path):
    names = make_folder(tmp_path, 2)
    cd.write_digests(tmp_path, cd.digests(tmp_path, names), run_id="old", iteration=1)
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    problems = cd.digest_problems(tmp_path, cd.read_digests(tmp_path), run_id="new", iteration=1)
    assert problems[0] == "hdp_digests.json belongs to run old, meta.json to run new"
    assert problems[1].startswith("__0_0.distcp holds 1 bytes, its digest says 1,000")
