"""The advisor and the simulator price sliding-window layers (hand formulas, tiny runs)."""

import json

import pytest

from megatron_hdp.sim.__main__ import main as sim_main
from megatron_hdp.sim.models import MODELS, with_window
from tests.unit.test_advise import MODEL_FLAGS, ROUND, H, advise, params, rows, step_by_hand


def test_advisor_prices_a_windowed_ring_by_hand(tmp_path):
    """32K tokens on a ring of 4, window 1023 on layers 1 and 3 (skip freq 2): the windowed
    layers compute s W - W^2/2 pairs (W = 1024) and send min(s/k, 2W) K/V rows per hop."""
    s, k, w = 32768, 4, 1024
    lengths = tmp_path / "one.txt"
    lengths.write_text(f"{s}\n")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(ROUND))
    common = [
        "--gpus", "4", "--profile", str(profile), "--lengths-file", str(lengths), "--steps", "1",
        "--megatron", "reimpl", *MODEL_FLAGS, "--seq-length", str(s), "--hdp-capacity", "8192",
        "--hdp-global-batch-tokens", str(s),
    ]  # fmt: skip
    rc, report = advise(
        tmp_path, *common, "--window-size", f"{w - 1},0", "--window-attn-skip-freq", "2"
    )
    assert rc == 0
    full, sync = step_by_hand(s, k, pool=4)
    f_lin = ROUND["peak_bf16_flops"] * ROUND["linear_efficiency"]
    f_att = ROUND["peak_bf16_flops"] * ROUND["attention_efficiency"]
    bw, lat = ROUND["network_bandwidth"], ROUND["network_latency"]
    per_pair = 3.5 * 4 * H / f_att  # heads x head dim = h
    att_full, att_win = 2 * per_pair * s * s / 2, 2 * per_pair * (s * w - w * w / 2)
    linear = 6 * params() * s / f_lin

    def ring(rows, attention):
        transfer = lat + 2 * rows * H * 2 / bw
        forward_step = attention / (k * k) / (3.5 * 2)
        return 2 * (
            (k - 1) * max(0, transfer - forward_step)
            + (k - 1) * max(0, 2 * transfer - 2.5 * forward_step)
            + transfer
        )

    member = (linear + att_full + att_win) / k
    member += ring(s / k, att_full) + ring(min(s / k, 2 * w), att_win)
    got = rows(report)
    for system in ("static", "hdp_greedy", "hdp_balance"):
        assert got[system]["step_time"] == pytest.approx(member + sync, rel=1e-9), system
        assert got[system]["step_time"] < full + sync


def test_simulator_prices_windows(tmp_path):
    model = with_window(MODELS["llama-7b"], (4095, 0), 4)
    assert (model.shape.window, model.shape.windowed_layers) == (4095, 24)
    with pytest.raises(ValueError, match="right window"):
        with_window(MODELS["llama-7b"], (4095, 3), None)
    flags = [
        "--models", "llama-7b", "--datasets", "github_like", "--contexts", "256K", "--steps",
        "1", "--scale-gpus", "0", "--gantt", "", "--no-charts", "--megatron", "reimpl",
        "--tokens", "4M", "--systems", "hdp_balance", "--fig5-model", "", "--claims-doc", "",
    ]  # fmt: skip
    times = {}
    for name, extra in (("full", []), ("window", ["--window-size", "4095,0"])):
        out = tmp_path / name
        assert sim_main(["--out", str(out), *flags, *extra]) == 0
        runs = json.loads((out / "sim.json").read_text())["runs"]
        times[name] = runs[0]["step_time"]
    assert times["window"] < times["full"]
