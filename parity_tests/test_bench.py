"""`rosetta bench` plumbing: run_bench on the tiny preset, for the structure only.

Speed is never asserted in a test (a shared CI machine makes any threshold flaky): these check the
shape of the result, that every time is positive and every ratio finite, that progress is
reported, and that a framework that cannot run is skipped with its reason.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import suite
from common.adapter.backends import unavailable_reason
from common.spec.config import preset

IMPLEMENTATIONS = suite.BENCH_FRAMEWORKS
INSTALLED = [name for name in IMPLEMENTATIONS if unavailable_reason(name) is None]
BATCH, LENGTH, REPEATS = 2, 8, 1


@pytest.fixture(scope="module")
def bench():
    """One run over every framework (plus the oracle, which has no benchmark) and its progress."""
    messages: list[str] = []
    result = suite.run_bench(
        [*IMPLEMENTATIONS, "numpy"],
        preset("tiny"),
        BATCH,
        LENGTH,
        LENGTH,
        REPEATS,
        messages.append,
    )
    return result, messages


def test_every_installed_framework_is_measured_and_the_rest_skipped_with_a_reason(bench):
    result, _ = bench
    assert list(result["results"]) == INSTALLED
    assert result["target"] == 1.15
    missing = [name for name in IMPLEMENTATIONS if name not in INSTALLED]
    assert sorted(result["skipped"]) == sorted([*missing, "numpy"])
    assert all(isinstance(reason, str) and reason for reason in result["skipped"].values())
    json.dumps(result)  # the --json output


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_result_structure_times_positive_ratios_finite(bench, framework):
    if framework not in INSTALLED:
        pytest.skip(f"{framework}: {unavailable_reason(framework)}")
    r = bench[0]["results"][framework]
    assert r["framework"] == framework
    assert isinstance(r["version"], str) and r["version"]
    assert isinstance(r["peer"], str) and r["peer"]
    keys = set(suite.CONTENDERS)
    assert set(r["median_s"]) == set(r["gflops"]) == set(r["fraction_of_matmul"]) == keys
    assert set(r["contenders"]) == keys
    assert all(t > 0 and math.isfinite(t) for t in r["median_s"].values())
    assert all(g > 0 and math.isfinite(g) for g in r["gflops"].values())
    assert r["fraction_of_matmul"]["matmul"] == pytest.approx(1.0)
    assert r["ratio"] == pytest.approx(r["median_s"]["ours"] / r["median_s"]["peer"])
    assert r["ratio_attention"] == pytest.approx(
        r["median_s"]["ours_attention"] / r["median_s"]["peer"]
    )
    assert math.isfinite(r["ratio"]) and math.isfinite(r["ratio_attention"])
    assert r["target"] == 1.15 and r["target_met"] == (r["ratio"] <= 1.15)
    # tiny (d 16, d_ff 32, 2+2 layers, vocab 48), batch 2, 8/8, counted by hand: per sequence
    # attention 20480, FFN 16384, encoder 2 * 36864, decoder 2 * 57344, logits 12288 FLOPs.
    assert r["forward_gflop"] == pytest.approx(2 * 200704 / 1e9)
    w = r["workload"]
    assert (w["batch"], w["src_len"], w["tgt_len"], w["repeats"]) == (BATCH, LENGTH, LENGTH, 1)
    assert (w["d_model"], w["src_vocab"], w["tgt_vocab"]) == (16, 48, 48)


def test_jax_peer_holds_our_weights_and_gives_our_logits(bench):
    if "jax" not in INSTALLED:
        pytest.skip(f"jax: {unavailable_reason('jax')}")
    gap = bench[0]["results"]["jax"]["max_abs_logit_gap_vs_peer"]
    # The same function in float32, up to summation order (tiny logits are O(1)).
    assert gap is not None and gap < 1e-5


def test_progress_names_each_framework_and_repeat(bench):
    _, messages = bench
    for name in INSTALLED:
        assert f"{name}: repeat {REPEATS}/{REPEATS}" in messages
    assert any(m.startswith("numpy: skipped") for m in messages)


def test_format_bench_prints_times_ratio_target_and_matmul_fraction(bench):
    text = suite.format_bench(bench[0])
    for name in INSTALLED:
        r = bench[0]["results"][name]
        assert f"{name}: {r['version']}" in text
        assert f"ratio ours/peer {r['ratio']:.3f} (target <= 1.15: " in text
    assert text.count("(ceiling)") == len(INSTALLED)
    assert text.count("% of matmul") == 3 * len(INSTALLED)
    assert "numpy: skipped (" in text


def test_alternate_takes_one_sample_per_round_after_the_warmup():
    calls: list[str] = []
    messages: list[str] = []
    contenders = {k: (lambda k=k: calls.append(k)) for k in ("a", "b")}
    times = suite.alternate("x", contenders, repeats=3, warmup=2, progress=messages.append)
    assert calls == ["a", "b"] * 5  # 2 warm-up rounds, then 3 timed rounds, in alternation
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert messages[-1] == "x: repeat 3/3" and len(messages) == 4
    with pytest.raises(ValueError, match="repeats"):
        suite.alternate("x", contenders, repeats=0, warmup=0, progress=None)


def test_module_main_prints_json_or_the_report(bench, capsys):
    if not INSTALLED:
        pytest.skip("no framework installed")
    name = INSTALLED[0]
    canned = bench[0]["results"][name]
    seen: list[tuple] = []

    def measure(config, batch, src_len, tgt_len, repeats, progress):
        seen.append((config.d_model, batch, src_len, tgt_len, repeats, progress))
        return canned

    assert suite.module_main(name, measure, ["--repeats", "2", "--json"], 7, "d") is canned
    assert json.loads(capsys.readouterr().out)["ratio"] == pytest.approx(canned["ratio"])
    assert seen[-1] == (512, 8, 128, 128, 2, None)  # the issues' workload, silent under --json
    suite.module_main(name, measure, [], 7, "d")
    assert "ratio ours/peer" in capsys.readouterr().out
    assert seen[-1][4] == 7 and seen[-1][5] is not None
