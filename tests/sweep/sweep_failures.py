# ruff: noqa: E501 - one case per line reads better in the tables below
"""A sweep of what a demanding user gets wrong, run as `python -m tests.sweep.sweep_failures`.

Classes (issues 35, 45): bad flags, the data spec, Ray faults, resume (damaged, foreign and
half-copied checkpoints too), disk, offload memory, data content. Every case runs the
real entry point (`pretrain_hdp.main`) and is classified by what the user sees:

- `clear`: exit status 1 or 2 with exactly one line `pretrain_hdp.py: error: ...` that
  names what the case expects (the flag, the value, the source, the file);
- `ok`: the job was accepted and that is right (a legal value; for runtime cases: it
  trained, with the result the case checks);
- `silent`: accepted although it should have been refused, or trained to a wrong result;
- `traceback`: any other exception (a traceback through our code or a library's);
- `hang`: no answer within the case's time limit.

Flag and spec cases validate only (`--hdp-validate-only`: validation, data set-up and the
resume checks, no process group), in this process, one after the other (a few minutes on
one core). Runtime cases (resume, disk) run 2 forked ranks each (`tests.dist.run_ranks`).
Prints one line per case that is not `clear`/`ok` and the counts per class; exits 1 when
any case is `silent`, `traceback` or `hang`. `--quick` runs a sample of the flag cases.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

from megatron_hdp.data.indexed import ensure_stdlib_corpus
from megatron_hdp.megatron.arguments import build_parser

CASE_TIMEOUT_S = 60

#: Flags where 0 is a legal value (off, none, or a real zero).
ZERO_OK = {
    "--min-lr", "--lr-warmup-iters", "--weight-decay", "--clip-grad", "--adam-beta1",
    "--adam-beta2", "--seed", "--moe-aux-loss-coeff", "--eval-iters", "--attention-dropout",
    "--hidden-dropout", "--hdp-prefetch-depth", "--hdp-skip-nonfinite-steps",
    "--hdp-stall-report-seconds", "--hdp-timeline-interval",
}  # fmt: skip
#: Flags that only apply with other flags, and the flags that make them apply.
NEEDS = {
    "--moe-router-topk": ["--num-experts", "4"],
    "--moe-ffn-hidden-size": ["--num-experts", "4"],
    "--moe-aux-loss-coeff": ["--num-experts", "4"],
    "--expert-model-parallel-size": ["--num-experts", "4"],
    "--num-query-groups": ["--group-query-attention"],
    "--save-interval": ["--save", "{tmp}/ckpt"],
    "--hdp-timeline-interval": ["--hdp-metrics-file", "{tmp}/m.jsonl"],
    "--vocab-size": ["--tokenizer-type", "NullTokenizer", "--data-path", "{tmp}/null"],
}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def small_job(cache: Path, extra=()) -> list[str]:
    from tests.e2e.harness import corpus_args

    return corpus_args(cache, iters=3, extra=[*extra, "--hdp-validate-only"])


def run_main(argv: list[str], *, world_size: int = 2, timeout_s: float = CASE_TIMEOUT_S):
    """`('exit', status, stderr)`, `('return', None, stderr)`, `('traceback', name, text)`
    or `('hang', None, '')` of `pretrain_hdp.main(argv)` in this process."""
    import pretrain_hdp

    err = io.StringIO()
    os.environ["WORLD_SIZE"] = str(world_size)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(timeout_s))
    try:
        with contextlib.redirect_stderr(err):
            pretrain_hdp.main(argv)
        return "return", None, err.getvalue()
    except SystemExit as done:
        return "exit", done.code, err.getvalue()
    except Timeout:
        return "hang", None, ""
    except Exception as exc:  # noqa: BLE001 - classified, not raised
        return "traceback", type(exc).__name__, f"{exc}"[:300]
    finally:
        signal.alarm(0)


def classify(result, *, refuse: bool | None, names: str | None) -> tuple[str, str]:
    """`refuse`: True (must be refused), False (must be accepted), None (either is right)."""
    kind, code, text = result
    if kind == "hang":
        return "hang", "no answer"
    if kind == "traceback":
        return "traceback", f"{code}: {text}"
    lines = [line for line in text.splitlines() if line.strip()]
    if kind == "exit" and code in (1, 2):
        if len(lines) == 1 and lines[0].startswith("pretrain_hdp.py: error: "):
            if names is None or names in lines[0]:
                return ("silent" if refuse is False else "clear"), lines[0]
            return "unclear", lines[0]
        return "traceback", f"exit {code}: {text[-300:]}"
    if kind == "exit" and code == 0 and not refuse:
        return "ok", text.strip()[-200:]
    if kind == "return":
        return ("silent" if refuse else "ok"), "accepted" + (" (judge)" if refuse is None else "")
    return "traceback", f"{kind} {code}: {text[-300:]}"


# ---------------------------------------------------------------- bad flags


def flag_cases(quick: bool):
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.type not in (int, float):
            continue
        name = action.option_strings[0]
        values = ["0", "-1", "1000000000"] if action.type is int else ["nan", "inf", "-1", "0"]
        if action.type is float:
            values.append("1e30")
        for value in values:
            refuse = value in ("nan", "inf", "-1") or (value == "0" and name not in ZERO_OK)
            if value in ("1000000000", "1e30"):
                refuse = None  # a huge value: refused by name, or accepted (listed to judge)
            yield name, value, refuse
        if quick:
            break


def sweep_flags(tmp: Path, cache: Path, quick: bool):
    null = tmp / "null"
    import numpy as np

    from megatron_hdp.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(n)).astype(np.int32) for n in rng.integers(30, 600, 40)]
    write_indexed_dataset(null, docs, vocab_size=1000)
    for name, value, refuse in flag_cases(quick):
        extra = [x.replace("{tmp}", str(tmp)) for x in NEEDS.get(name, [])]
        argv = small_job(cache, [*extra, name, value])
        outcome, detail = classify(run_main(argv), refuse=refuse, names=f"{name} ")
        yield f"{name} {value}", outcome, detail
    for name, value in (("--seed", str(2**63)), ("--hdp-prefetch-depth", "65")):
        outcome, detail = classify(
            run_main(small_job(cache, [name, value])), refuse=True, names=name
        )
        yield f"{name} {value}", outcome, detail


# ---------------------------------------------------------------- data spec


def spec_cases(tmp: Path):
    """(name, spec file text and suffix, refuse?, text the message must hold)."""
    lib = {"name": "lib", "builtin": "stdlib"}
    j = json.dumps
    yield "huge weights", j({"sources": [{**lib, "weight": 1e308}]}), ".json", False, None
    yield "two huge weights", (
        j({"sources": [{**lib, "weight": 1e308}, {"name": "b", "builtin": "stdlib", "weight": 1e308}]})
    ), ".json", False, None  # fmt: skip
    yield "tiny weight", j({"sources": [{**lib, "weight": 5e-324}]}), ".json", False, None
    yield "string weight", j({"sources": [{**lib, "weight": "1"}]}), ".json", True, "'1'"
    yield "negative weight", j({"sources": [{**lib, "weight": -1}]}), ".json", True, "-1"
    yield "loaders 0", j({"sources": [{**lib, "loaders": 0}]}), ".json", True, "loaders"
    yield "loaders 65", j({"sources": [{**lib, "loaders": 65}]}), ".json", True, "65"
    yield "loaders '2'", j({"sources": [{**lib, "loaders": "2"}]}), ".json", True, "'2'"
    yield "no sources", j({"sources": []}), ".json", True, "sources"
    yield "top-level list", j([lib]), ".json", True, "top level"
    yield "unknown key", j({"sources": [lib], "source": 1}), ".json", True, "source"
    yield (
        "missing path",
        j({"sources": [{"name": "a", "path": "nowhere"}]}),
        ".json",
        True,
        "nowhere",
    )
    yield (
        "missing jsonl",
        j({"sources": [{"name": "a", "jsonl": "no.jsonl"}]}),
        ".json",
        True,
        "no.jsonl",
    )
    (tmp / "empty.jsonl").write_text("")
    yield (
        "empty jsonl",
        j({"sources": [{"name": "a", "jsonl": str(tmp / "empty.jsonl")}]}),
        ".json",
        True,
        "empty.jsonl",
    )
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    yield (
        "bad jsonl line",
        j({"sources": [{"name": "a", "jsonl": str(tmp / "bad.jsonl")}]}),
        ".json",
        True,
        "bad.jsonl",
    )
    (tmp / "nokey.jsonl").write_text('{"body": "no text key"}\n')
    yield (
        "jsonl without the key",
        j({"sources": [{"name": "a", "jsonl": str(tmp / "nokey.jsonl")}]}),
        ".json",
        True,
        "nokey.jsonl",
    )
    yield (
        "schedule too short",
        j({"sources": [lib], "schedule": [{"until_step": 2, "weights": {"lib": 1}}]}),
        ".json",
        True,
        "--train-iters",
    )
    yield (
        "schedule all zero",
        j({"sources": [lib], "schedule": [{"until_step": 9, "weights": {"lib": 0}}]}),
        ".json",
        True,
        "all zero",
    )
    yield (
        "weight on an empty bucket",
        j(
            {
                "sources": [lib],
                "length_buckets": [{"name": "s", "max_tokens": 100000}, {"name": "l"}],
                "schedule": [{"until_step": 9, "weights": {"lib/l": 1}}],
            }
        ),
        ".json",
        True,
        "lib/l",
    )
    yield (
        "yaml 1e-3",
        "sources:\n  - {name: lib, builtin: stdlib, weight: 1e-3}\n",
        ".yaml",
        False,
        None,
    )
    yield (
        "yaml 1.5e3",
        "sources:\n  - {name: lib, builtin: stdlib, weight: 1.5e3}\n",
        ".yaml",
        False,
        None,
    )
    yield (
        "yaml .inf",
        "sources:\n  - {name: lib, builtin: stdlib, weight: .inf}\n",
        ".yaml",
        True,
        "inf",
    )
    yield "yaml tab error", "sources:\n\t- x\n", ".yaml", True, "YAML"
    yield "not json", "{", ".json", True, "JSON"
    yield "binary file", "\x00\x01\x02", ".json", True, "JSON"


def sweep_spec(tmp: Path, cache: Path):
    for k, (name, text, suffix, refuse, names) in enumerate(spec_cases(tmp)):
        path = tmp / f"spec{k}{suffix}"
        path.write_text(text)
        from tests.e2e.harness import corpus_args

        argv = corpus_args(
            cache, iters=3, extra=["--hdp-data-spec", str(path), "--hdp-validate-only"]
        )
        outcome, detail = classify(run_main(argv), refuse=refuse, names=names)
        yield f"spec: {name}", outcome, detail


# ---------------------------------------------------------------- Ray faults


def _listener(answer: bytes | None) -> int:
    server = socket.create_server(("127.0.0.1", 0))

    def loop():
        while True:
            conn, _ = server.accept()
            conn.recv(64)
            if answer is not None:
                conn.sendall(answer)
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return server.getsockname()[1]


def sweep_ray(tmp: Path, cache: Path):
    silent, http = _listener(None), _listener(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    closing = _listener(b"")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    unused = free.getsockname()[1]
    free.close()
    cases = [
        ("nothing listens", f"127.0.0.1:{unused}", "Connection refused"),
        ("silent port", f"127.0.0.1:{silent}", "not a Ray head"),
        ("http port", f"127.0.0.1:{http}", "not a Ray head"),
        ("closing port", f"127.0.0.1:{closing}", "not a Ray head"),
        ("port 0", "127.0.0.1:0", "HOST:PORT"),
        ("port 70000", "127.0.0.1:70000", "HOST:PORT"),
        ("no port", "127.0.0.1", "HOST:PORT"),
        ("ray client URL", "ray://127.0.0.1:10001", "Ray Client URL"),
        ("unknown host", "no-such-host.invalid:6379", "no-such-host.invalid"),
    ]
    for name, address, names in cases:
        argv = small_job(cache, ["--hdp-data-service", "ray", "--hdp-ray-address", address])
        outcome, detail = classify(run_main(argv, timeout_s=30), refuse=True, names=names)
        yield f"ray: {name}", outcome, detail
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{http}"
    try:
        argv = small_job(cache, ["--hdp-data-service", "ray"])
        outcome, detail = classify(run_main(argv, timeout_s=30), refuse=True, names="RAY_ADDRESS")
        yield "ray: RAY_ADDRESS at a stale port", outcome, detail
    finally:
        del os.environ["RAY_ADDRESS"]


# ---------------------------------------------------------------- resume and disk


def _train(argv, world_size=2, timeout_s=240.0):
    """Runs `pretrain_hdp.main(argv)` on forked ranks: ('ok', records) or ('error', report)."""
    from tests.e2e.harness import run_pretrain

    try:
        return "ok", run_pretrain(world_size, argv, timeout_s=timeout_s)
    except AssertionError as err:
        text = str(err)
        return ("hang" if text.startswith("timed out") else "error"), text


def _runtime_outcome(result, *, want_line: str | None, forbid=("Traceback",)) -> tuple[str, str]:
    kind, payload = result
    if kind == "hang":
        return "hang", payload[:200]
    if kind == "ok":
        return ("ok" if want_line is None else "silent"), "trained"
    if want_line is None:
        return "traceback", payload[-300:]
    sections = re.split(r"^rank \d+ failed:$", payload, flags=re.M)[1:]
    ends = [
        [x for x in sec.strip().splitlines() if x.strip()][-1] for sec in sections if sec.strip()
    ]
    if sections and all(re.match(r"SystemExit: [12]$", end) for end in ends):
        return ("clear" if want_line in payload else "unclear"), ends[-1]
    return "traceback", " | ".join(e for e in ends if not e.startswith("SystemExit"))[-300:]


def sweep_resume(tmp: Path, cache: Path):
    from tests.e2e.harness import corpus_args

    ckpt = tmp / "run"
    fixed = ["--lr-decay-iters", "8"]  # one schedule for the 2-step run and its resumes
    base = corpus_args(cache, iters=2, extra=[*fixed, "--save", str(ckpt)])
    kind, _ = _train(base)
    yield "resume: the 2-step run itself", ("ok" if kind == "ok" else "traceback"), kind

    def resumed(extra, iters=4, folder=ckpt):
        copy = tmp / f"copy{len(os.listdir(tmp))}"
        shutil.copytree(folder, copy)
        return copy, corpus_args(cache, iters=iters, extra=[*fixed, "--load", str(copy), *extra])

    checks = [
        ("changed --seed", ["--seed", "6"], "--seed"),
        ("changed --seq-length", ["--seq-length", "256"], "--seq-length"),
        ("changed --hidden-size", ["--hidden-size", "64"], "--hidden-size"),
        ("changed global batch", ["--hdp-global-batch-tokens", "4096"], "global batch"),
        (
            "distributed optimizer switched on",
            ["--use-distributed-optimizer"],
            "use_distributed_optimizer",
        ),
    ]
    for name, extra, names in checks:
        _, argv = resumed(extra)
        outcome, detail = classify(
            run_main([*argv, "--hdp-validate-only"]), refuse=True, names=names
        )
        yield f"resume: {name}", outcome, detail
    copy, argv = resumed([])
    (copy / "latest_checkpointed_iteration.txt").write_text("two\n")
    outcome, detail = classify(run_main([*argv, "--hdp-validate-only"]), refuse=True, names="two")
    yield "resume: tracker not a number", outcome, detail
    copy, argv = resumed([])
    (copy / "iter_0000002" / "meta.json").write_text("{not json")
    outcome, detail = classify(
        run_main([*argv, "--hdp-validate-only"]), refuse=True, names=str(copy)
    )
    yield "resume: meta.json corrupt", outcome, detail
    copy, argv = resumed([])
    (copy / "latest_checkpointed_iteration.txt").write_text("7\n")
    outcome, detail = classify(run_main([*argv, "--hdp-validate-only"]), refuse=True, names="7")
    yield "resume: tracker names a missing iteration", outcome, detail
    outcome, detail = classify(
        run_main([*corpus_args(cache, iters=4, extra=["--load", str(tmp / "nothing")]), "--hdp-validate-only"]),
        refuse=True, names="nothing",
    )  # fmt: skip
    yield "resume: --load of a missing folder", outcome, detail
    copy, argv = resumed([])
    common = copy / "iter_0000002" / "common.pt"
    common.write_bytes(common.read_bytes()[: common.stat().st_size // 2])
    outcome, detail = _runtime_outcome(_train(argv), want_line="common.pt")
    yield "resume: common.pt truncated", outcome, detail
    yield from _damaged_checkpoints(tmp, cache, resumed, ckpt)
    copy, argv = resumed([])
    steps_kind, steps = _train(argv)
    fresh_kind, fresh = _train(corpus_args(cache, iters=4, extra=fixed))
    if steps_kind == fresh_kind == "ok":
        same = [s["loss"] for s in steps] == [s["loss"] for s in fresh[2:]]
        yield "resume: continues exactly", ("ok" if same else "silent"), f"{same}"
    else:
        yield "resume: continues exactly", "traceback", f"{steps_kind} {fresh_kind}"


def _damaged_checkpoints(tmp: Path, cache: Path, resumed, ckpt: Path):
    """Issue 45: files damaged, copied in or missing, and data rewritten, each refused."""
    from megatron_hdp.checkpoint_digests import DIGESTS
    from tests.e2e.harness import corpus_args

    def shard(copy):
        return max((copy / "iter_0000002").glob("*.distcp"), key=lambda p: p.stat().st_size)

    def validate(argv, names):
        return classify(run_main([*argv, "--hdp-validate-only"]), refuse=True, names=names)

    copy, argv = resumed([])
    zeroed = shard(copy)
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    yield "resume: a zeroed shard", *validate(argv, zeroed.name)
    copy, argv = resumed([])
    flipped = shard(copy)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    flipped.write_bytes(bytes(data))
    yield "resume: one bit flipped in a shard", *validate(argv, flipped.name)
    other = tmp / "other-run"
    kind, _ = _train(corpus_args(cache, iters=2, extra=["--lr-decay-iters", "8", "--seed", "9", "--save", str(other)]))  # fmt: skip
    if kind == "ok":
        copy, argv = resumed([])
        foreign = shard(copy)
        shutil.copy(other / "iter_0000002" / foreign.name, foreign)
        yield "resume: a shard copied in from another run", *validate(argv, foreign.name)
    for name in (".metadata", "metadata.json", DIGESTS):
        copy, argv = resumed([])
        (copy / "iter_0000002" / name).write_bytes(b"garbled")
        yield f"resume: {name} garbled", *validate(argv, name)
    copy, argv = resumed([])
    (copy / "iter_0000002" / ".metadata").unlink()
    yield "resume: .metadata missing", *validate(argv, ".metadata")
    copy, argv = resumed([])
    (copy / "iter_0000002" / DIGESTS).unlink()
    (copy / "iter_0000002" / "metadata.json").unlink()
    yield "resume: half-copied, no digests, no metadata.json", *validate(argv, "metadata.json")
    copy, argv = resumed([])
    (copy / "iter_0000002" / DIGESTS).unlink()
    outcome, detail = classify(run_main([*argv, "--hdp-validate-only"]), refuse=False, names=None)
    yield "resume: written before digests (accepted)", outcome, detail


def _full_disk_after(calls: int, path_part: str):
    """Patch `open` for writing under `path_part`: ENOSPC from the `calls`-th file on."""
    import builtins

    real_open = builtins.open
    count = [0]

    def fake_open(file, mode="r", *args, **kwargs):
        if path_part in str(file) and any(m in mode for m in "wax"):
            count[0] += 1
            if count[0] >= calls:
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    return fake_open


def sweep_disk(tmp: Path, cache: Path):
    import builtins

    from tests.e2e.harness import corpus_args

    real_open = builtins.open
    cases = [
        ("checkpoint, first file", "ckpt", 1, ["--save", str(tmp / "ckpt")], "No space left"),
        (
            "checkpoint, second save",
            "ckpt2",
            4,
            ["--save", str(tmp / "ckpt2"), "--save-interval", "1"],
            "No space left",
        ),
        ("metrics file", "m.jsonl", 1, ["--hdp-metrics-file", str(tmp / "m.jsonl")], "m.jsonl"),
        (
            "timeline files",
            "timeline",
            1,
            ["--hdp-metrics-file", str(tmp / "mt.jsonl"), "--hdp-timeline-interval", "1"],
            "timeline",
        ),
    ]
    for name, part, calls, extra, want in cases:
        builtins.open = io.open = _full_disk_after(calls, part)  # the forked ranks inherit it
        try:
            result = _train(corpus_args(cache, iters=2, extra=extra))
        finally:
            builtins.open = io.open = real_open
        outcome, detail = _runtime_outcome(result, want_line=want)
        yield f"disk: {name}", outcome, detail
    if os.geteuid() == 0:  # root writes through any mode bits: nothing to refuse
        return
    ro = tmp / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        argv = small_job(cache, ["--save", str(ro / "ckpt")])
        outcome, detail = classify(run_main(argv), refuse=True, names=str(ro))
        yield "disk: --save under a read-only folder", outcome, detail
    finally:
        os.chmod(ro, 0o700)


def sweep_flags_at_run_time(tmp: Path, cache: Path):
    """Huge values validation accepts, trained for 2 steps: they run, or stop in one line."""
    from tests.e2e.harness import corpus_args

    cases = [
        ("--hdp-capacity", "1000000000", None),
        ("--max-position-embeddings", "1000000000", None),
        ("--init-method-std", "1e30", "not finite"),  # the non-finite guard stops it
        ("--lr", "1e30", "not finite"),
    ]
    for name, value, want in cases:
        result = _train(corpus_args(cache, iters=2, extra=[name, value]))
        outcome, detail = _runtime_outcome(result, want_line=want)
        yield f"{name} {value} (2 steps)", outcome, detail


def sweep_offload_memory(tmp: Path, cache: Path):
    """Issue 45: offload pools the machine cannot hold, refused before start-up."""
    from megatron_hdp.offload.host_budget import available_memory_bytes

    available_gb = (available_memory_bytes() or 2**40) / 1e9
    cases = [
        ("1e6 GB", ["--hdp-host-memory-gb", "1e6"], "1", True),
        (
            "4 ranks of 8 GB on this machine",
            ["--hdp-host-memory-gb", f"{available_gb / 3:.3g}"],
            "4",
            True,
        ),  # fmt: skip
        ("the default (a share of available memory)", [], "4", False),
        ("a budget that fits", ["--hdp-host-memory-gb", "0.5"], "4", False),
    ]
    for name, extra, local, refuse in cases:
        os.environ["LOCAL_WORLD_SIZE"] = local
        try:
            result = run_main(small_job(cache, ["--hdp-offload", *extra]))
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        names = "--hdp-host-memory-gb" if refuse else None
        yield f"offload: {name}", *classify(result, refuse=refuse, names=names)


def sweep_data_content(tmp: Path, cache: Path):
    """Issue 45: a resume checks its datasets by content, wherever they live."""
    from megatron_hdp.data.indexed import write_indexed_dataset
    from tests.e2e.harness import SMALL_MODEL

    (tmp / "data").mkdir()
    docs = [[(7 * i + j) % 250 for j in range(40 + 13 * (i % 9))] + [256] for i in range(60)]
    write_indexed_dataset(tmp / "data" / "a", docs, vocab_size=257)

    def job(prefix, *extra):
        return [
            *SMALL_MODEL,
            *("--seq-length", "256", "--hdp-capacity", "128", "--lr", "3e-3"),
            *("--lr-decay-iters", "4"),
            *("--split", "100,0,0", "--data-path", str(prefix), *extra),
        ]

    kind, _ = _train([*job(tmp / "data" / "a", "--train-iters", "1", "--save", str(tmp / "ck"))])
    if kind != "ok":
        yield "data: the run to resume", "traceback", kind
        return
    moved = tmp / "moved"
    shutil.copytree(tmp / "data", moved)
    resume = ["--train-iters", "2", "--load", str(tmp / "ck"), "--hdp-validate-only"]
    yield "data: a moved copy", *classify(run_main(job(moved / "a", *resume)), refuse=False, names=None)  # fmt: skip
    data = bytearray((moved / "a.bin").read_bytes())
    (moved / "a.bin").write_bytes(bytes((x + 1) % 250 for x in data))  # same lengths
    result = run_main(job(moved / "a", *resume))
    yield (
        "data: rewritten with the same lengths",
        *classify(result, refuse=True, names="fingerprint"),
    )


CLASSES = {
    "bad flags": sweep_flags,
    "bad flags, run": sweep_flags_at_run_time,
    "data spec": sweep_spec,
    "Ray faults": sweep_ray,
    "resume": sweep_resume,
    "disk": sweep_disk,
    "offload memory": sweep_offload_memory,
    "data content": sweep_data_content,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CLASSES), action="append")
    parser.add_argument("--quick", action="store_true", help="one flag's cases only")
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    counts: dict[str, Counter] = {}
    bad = 0
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"
        ensure_stdlib_corpus(cache)
        for name, sweep in CLASSES.items():
            if args.only and name not in args.only:
                continue
            tmp = Path(folder) / name.replace(" ", "-")
            tmp.mkdir()
            kwargs = {"quick": args.quick} if sweep is sweep_flags else {}
            counts[name] = Counter()
            for case, outcome, detail in sweep(tmp, cache, **kwargs):
                counts[name][outcome] += 1
                if outcome not in ("clear", "ok") or "(judge)" in detail:
                    print(f"[{name}] {case}: {outcome}: {detail}", flush=True)
                bad += outcome in ("silent", "traceback", "hang", "unclear")
    print()
    for name, counter in counts.items():
        total = sum(counter.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))
        print(f"{name}: {total} cases: {parts}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
