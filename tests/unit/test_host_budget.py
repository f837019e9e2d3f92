"""The offload pool's size per process, and the check that this machine can hold it.

Reference figures are worked out by hand from the stated rule (docs/offload-host-memory.md):
the default is half the available memory split among the machine's processes; a given
budget must leave a fifth of the available memory free.
"""

from __future__ import annotations

import pytest

from megatron_hdp.offload import host_budget as hb

GIB = 2**30


def test_without_the_flag_each_process_takes_half_the_available_memory_over_local_ranks():
    budget = hb.host_budget(None, local=8, available=128 * GIB)
    assert budget.nbytes == 8 * GIB  # 0.5 * 128 GiB / 8
    assert "50% of the 128.0 GiB available on this machine, shared by 8 local processes" in (
        budget.why
    )


def test_the_flag_is_taken_as_given_in_gb():
    budget = hb.host_budget(12.5, local=8, available=1)
    assert budget.nbytes == 12_500_000_000
    assert budget.why == "--hdp-host-memory-gb 12.5"


def test_without_the_flag_an_os_that_does_not_say_gets_a_clear_message(monkeypatch):
    monkeypatch.setattr(hb, "available_memory_bytes", lambda: None)
    with pytest.raises(ValueError, match="give --hdp-host-memory-gb"):
        hb.host_budget(None, local=1, available=None)


def test_the_audit_s_case_128_gb_on_a_128_gib_machine_is_refused():
    """128e9 B = 119 GiB passed the old guard (physical memory) on the GPU machine."""
    problem = hb.budget_problem(128, local=1, available=126 * GIB)
    assert problem is not None
    assert problem.startswith("--hdp-host-memory-gb 128: 1 process on this machine would take")
    assert "119.2 GiB" in problem and "80% of the 126.0 GiB available" in problem


def test_four_ranks_of_8_gb_on_23_gib_are_refused_and_the_largest_that_fits_is_named():
    problem = hb.budget_problem(8, local=4, available=23 * GIB)
    assert problem is not None
    assert "4 processes on this machine would take 29.8 GiB" in problem
    # 0.8 * 23 GiB / 4 = 4.94e9 bytes: at most 4.94 GB each
    assert "give at most 4.94" in problem
    assert hb.budget_problem(4.9, local=4, available=23 * GIB) is None


def test_the_default_always_passes_the_check():
    for local in (1, 2, 8, 72):
        for available in (GIB, 23 * GIB, 2048 * GIB):
            gb = hb.host_budget(None, local=local, available=available).nbytes / 1e9
            assert hb.budget_problem(gb, local=local, available=available) is None


def test_pinning_leaves_two_gib_available_at_the_moment_it_pins():
    assert hb.pin_problem(10 * GIB, 12 * GIB) is None
    problem = hb.pin_problem(10 * GIB, 12 * GIB - 1)
    assert problem is not None and "10.0 GiB would leave less than 2.0 GiB" in problem
    assert hb.pin_problem(10 * GIB, None) is None


def test_available_memory_is_read_from_meminfo_not_physical_memory(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: 600 kB\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(meminfo if path == "/proc/meminfo" else path, *a, **k),
    )
    assert hb.available_memory_bytes() == 600 * 1024
