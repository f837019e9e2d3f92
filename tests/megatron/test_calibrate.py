"""The calibration command times the kernel the job would run, on the job's device."""

from __future__ import annotations

import json
import logging

import torch

from megatron_hdp.attention.kernels.device import DeviceFacts
from megatron_hdp.megatron import calibrate

H100 = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), flash_built=True)


def test_fp32_on_a_gpu_is_refused_before_any_process_group(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(DeviceFacts, "of", classmethod(lambda cls, device: H100))
    started = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: started.append(1))
    with caplog.at_level(logging.ERROR):
        status = calibrate.main(["--out", str(tmp_path / "p.json")])
    assert status == 2 and not started
    assert "--bf16" in caplog.text and "torch_flash" in caplog.text
    assert not (tmp_path / "p.json").exists()


def test_cpu_calibration_times_every_length_and_writes_a_profile(tmp_path, monkeypatch):
    # The fit itself is tested in tests/unit/test_cost.py; here timings this short would make
    # it reject noisy coefficients now and then, so it gets the measured seconds and returns
    # the base profile.
    timed = []

    def fit(lengths, seconds, shape, base, name):
        timed.append((list(lengths), list(seconds)))
        return base

    monkeypatch.setattr(calibrate, "fit_profile", fit)
    out = tmp_path / "profile.json"
    status = calibrate.main(["--out", str(out), "--lengths", "64", "128", "256", "--repeats", "1"])
    assert status == 0 and out.exists() and out.with_suffix(".fit.json").exists()
    assert timed[0][0] == [64, 128, 256] and all(s > 0 for s in timed[0][1])
    assert json.loads(out.with_suffix(".fit.json").read_text())["kernel"] == "torch"
