"""benchmarks/bench_scale.py (weak and strong scaling of data-parallel training) at tiny sizes:
the plumbing and the arithmetic, not the speed (a shared CI machine makes any threshold flaky).

One run of the command line, on torch: its children are torchrun jobs whose calls cost tens of
milliseconds beyond their steps, and it compiles nothing, where the JAX and Keras engines spend
about 10 s compiling each tiny training step on 2 shared cores (four compiles at least: the plain
loop and the engine at N=1, the engine at N=2 on two batch shapes), past this file's budget.
OMP_NUM_THREADS=1 for the run (the benchmark keeps a value the user set): on 2 cores that other
processes share, torch's 2 OpenMP threads at N=1 spin and its steps slow 10-30x (measured here:
60-200 ms against 7-10 ms a tiny step), which would cost this test half a minute.

Checked: a row for every N and kind (and the plain loop's), each with positive times; the step
time is the median of the pairs' (T(1 + K) - T(1)) / K from the recorded calls; the target
tokens are recounted here from the task's batches; tokens/s, speed-up, efficiency and the ratios
to the plain loop follow from the recorded figures; torchrun started N processes; the CPU is
labelled as the engine's overhead, not a speed-up; bad arguments are one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import numpy as np
import pytest

from transformer_rosetta.app.tasks import PAD_ID, get_task
from transformer_rosetta.benchmarks import bench_scale

STEPS, REPEATS, BATCH, PER_DEVICE = 20, 3, 4, 2
DEVICES = (1, 2)
KINDS = ("strong", "weak")
PROG = "python -m transformer_rosetta.benchmarks.bench_scale"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the command line: torch, N in {1, 2}, the tiny model; the JSON and the table."""
    folder = tmp_path_factory.mktemp("bench_scale")
    out, table = folder / "scale.json", folder / "scale.markdown"
    argv = [
        "--frameworks", "torch", "--devices", "1,2", "--model", "tiny",
        "--batch", str(BATCH), "--per-device-batch", str(PER_DEVICE),
        "--steps", str(STEPS), "--repeats", str(REPEATS),
        "--out", str(out), "--markdown", str(table),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        code = bench_scale.main(argv)
    result = json.loads(out.read_text())
    assert code == 0, [
        (r["engine"], r["kind"], r["devices"], r.get("reason")) for r in result["results"]
    ]
    return result, table.read_text()


def rows_by_key(result):
    return {(r["engine"], r["kind"], r["devices"]): r for r in result["results"]}


def test_a_row_for_every_n_and_kind_with_its_batch(run):
    result, _ = run
    rows = rows_by_key(result)
    expected = {("plain", k, 1) for k in KINDS} | {("mesh", k, n) for k in KINDS for n in DEVICES}
    assert set(rows) == expected and len(result["results"]) == len(expected)
    for (engine, kind, n), r in rows.items():
        assert r["status"] == "ok", r.get("reason")
        assert r["framework"] == "torch" and r["device"] == "cpu"
        if kind == "strong":  # the global batch stays; each device takes its share
            assert (r["global_batch"], r["per_device_batch"]) == (BATCH, BATCH // n)
        else:  # the per-device batch stays; the global one grows with N
            assert (r["global_batch"], r["per_device_batch"]) == (n * PER_DEVICE, PER_DEVICE)
        assert r["mesh"] == (f"data={n},model=1" if engine == "mesh" else "one device")


def test_every_time_is_positive_and_the_step_is_the_median_of_the_pairs(run):
    result, _ = run
    for r in result["results"]:
        assert len(r["short_call_s"]) == len(r["long_call_s"]) == REPEATS
        assert min(r["short_call_s"]) > 0 and min(r["long_call_s"]) > 0
        assert r["first_call_s"] > 0 and r["startup_s"] > 0
        pairs = [(b - a) / STEPS for a, b in zip(r["short_call_s"], r["long_call_s"], strict=True)]
        assert r["step_s"] == pytest.approx(statistics.median(pairs), rel=1e-12)
        assert r["step_s"] > 0
        # a call's fixed cost: the 1-step call less the one step it ran
        assert r["call_overhead_s"] == pytest.approx(
            statistics.median(r["short_call_s"]) - r["step_s"]
        )
        assert np.isfinite(r["last_loss"]) and r["last_loss"] > 0


def test_tokens_per_second_are_the_timed_batches_tokens_over_their_time(run):
    result, _ = run
    for r in result["results"]:
        # The batches recounted here: the numbers task's stream (seed 0) at the row's global
        # batch, the first 1 + K; the K after the first are the timed ones.
        task = dataclasses.replace(get_task("numbers"), batch_size=r["global_batch"])
        stream = task.train_batches(0)
        batches = [stream.next_batch() for _ in range(1 + STEPS)]
        assert all(tgt.shape[0] == r["global_batch"] for _, tgt in batches)
        tokens = sum(int(np.count_nonzero(tgt != PAD_ID)) for _, tgt in batches[1:])
        positions = sum(tgt.size for _, tgt in batches[1:])
        assert 0 < tokens < positions  # ragged: some target positions are padding
        assert r["timed_target_tokens"] == tokens
        assert r["tokens_per_s"] == pytest.approx(tokens / (STEPS * r["step_s"]), rel=1e-12)


def test_speedup_efficiency_and_the_plain_loop(run):
    result, _ = run
    rows = rows_by_key(result)
    for kind in KINDS:
        one, plain = rows[("mesh", kind, 1)], rows[("plain", kind, 1)]
        assert plain["vs_plain"] == pytest.approx(1.0)
        # the engine's own overhead at N=1: the plain loop's tokens/s over the engine's
        assert one["overhead_vs_plain"] == pytest.approx(
            plain["tokens_per_s"] / one["tokens_per_s"]
        )
        for n in DEVICES:
            r = rows[("mesh", kind, n)]
            speedup = r["tokens_per_s"] / one["tokens_per_s"]
            assert r["speedup"] == pytest.approx(speedup, rel=1e-12)
            assert r["efficiency"] == pytest.approx(speedup / n, rel=1e-12)
            assert r["vs_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
            if kind == "strong":  # the same batches at every N: the ratio of step times
                assert r["speedup"] == pytest.approx(one["step_s"] / r["step_s"], rel=1e-9)
        assert rows[("mesh", kind, 1)]["speedup"] == pytest.approx(1.0)


def test_torchrun_started_n_processes_on_the_cpu(run):
    result, _ = run
    engine = [c for c in result["children"] if c["engine_env"]]
    assert sorted(c["devices"] for c in engine) == list(DEVICES)
    cores = len(os.sched_getaffinity(0))
    for c in engine:
        assert c["status"] == "ok"
        assert c["seen"] == {"platform": "cpu", "count": cores, "processes": c["devices"]}
    assert result["devices_seen"]["torch"]["platform"] == "cpu"


def test_the_cpu_is_labelled_as_the_engines_overhead(run):
    result, table = run
    cores = len(os.sched_getaffinity(0))
    label = [n for n in result["notes"] if "not a speed-up" in n]
    assert len(label) == 1 and f"{cores} cores" in label[0]
    assert "the engine's overhead, not a speed-up" in table
    m = result["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["ram_bytes"] > 0 and "torch" in m["versions"]
    assert m["gpus"] == {}
    # one table line per row, in the order of the JSON's rows
    lines = [line for line in table.splitlines() if line.startswith("| torch | ")]
    assert len(lines) == 2 * len(result["results"])  # the figures, then the start-up


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--devices", "0"], "device counts are whole numbers >= 1"),
        (["--devices", "two"], "device counts, e.g. 1,2"),
        (["--frameworks", "mxnet"], "unknown framework mxnet"),
        (["--batch", "3", "--devices", "1,2"], "does not divide over N = 2"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, words, capsys):
    assert bench_scale.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{PROG}: error:") and words in err


def test_an_existing_output_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "scale.json"
    out.write_text("kept")
    assert bench_scale.main(["--frameworks", "torch", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "probing" not in err
    assert out.read_text() == "kept"


def test_a_step_time_lost_in_the_noise_fails_the_row_and_a_wide_spread_is_marked():
    raw = {"short_call_s": [1.0, 1.0, 1.0], "long_call_s": [1.3, 1.4, 3.0], "first_call_s": 5.0}
    fig = bench_scale.summarise_case({**raw, "last_loss": 2.0}, steps=10, timed_tokens=100)
    # pairs 0.03, 0.04, 0.2 s a step: the median 0.04; the spread 0.17 > half of it
    assert fig["status"] == "ok" and fig["step_s"] == pytest.approx(0.04) and fig["noisy"]
    assert fig["tokens_per_s"] == pytest.approx(100 / (10 * 0.04))
    raw["long_call_s"] = [0.9, 1.2, 0.95]  # two of three pairs below zero
    fig = bench_scale.summarise_case({**raw, "last_loss": 2.0}, steps=10, timed_tokens=100)
    assert fig["status"] == "failed" and "raise --steps" in fig["reason"]
    assert "tokens_per_s" not in fig


def test_forced_host_devices_replace_an_earlier_count():
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8"}
    flags = bench_scale.forced_devices(env, 2)["XLA_FLAGS"].split()
    assert flags == ["--xla_cpu_enable_fast_math=false", "--xla_force_host_platform_device_count=2"]


def test_a_failed_childs_reason_is_its_error_not_torchruns_summary():
    stderr = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "transformer_rosetta.errors.InputError: --mesh data=2,model=1: the batch of 3 rows ...",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "============================================================",
            "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
            "============================================================",
        ]
    )
    assert bench_scale.failure_line(stderr).startswith(
        "transformer_rosetta.errors.InputError: --mesh"
    )


def test_an_aborted_childs_reason_is_xlas_fatal_line_not_its_stack():
    stderr = "\n".join(
        [
            "E1127 09:34:11.606636   25430 rendezvous.cc:116] [id=0] This thread has been waiting",
            "F1127 09:34:51.610496   25430 rendezvous.cc:161] [id=0] Termination timeout for `all "
            "reduce` of 40 seconds exceeded.",
            "*** Check failure stack trace: ***",
            "    @     0x7f2f934a71f5  (unknown)",
        ]
    )
    assert bench_scale.failure_line(stderr).startswith("F1127 09:34:51.610496")
    assert "Termination timeout" in bench_scale.failure_line(stderr)


def test_the_default_strong_batch_is_divided_by_every_n():
    # per device x the largest N: every N of the default list (powers of two, then the count)
    assert bench_scale.strong_batch({"torch": [1, 2]}, None, 32) == 64
    assert bench_scale.strong_batch({"jax": bench_scale.default_devices(6)}, None, 32) == 192
    assert bench_scale.default_devices(6) == [1, 2, 4, 6]
    assert bench_scale.default_devices(1) == [1]
    assert bench_scale.strong_batch({"jax": [1, 2]}, 10, 32) == 10  # --batch, as given
    with pytest.raises(bench_scale.UsageError, match="does not divide over N = 4, 6"):
        bench_scale.strong_batch({"jax": [1, 2, 4, 6]}, 10, 32)
