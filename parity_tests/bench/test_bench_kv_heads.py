"""benchmarks/bench_kv_heads.py at tiny_llama's sizes, for the structure and the cache bytes.

Speed is never asserted (a shared CI machine makes any threshold flaky). What is asserted: every
framework's stepper holds the spec's key/value cache, 2 * layers * num_kv_heads * d_k * 4 bytes
per token in float32 (measured from the buffers it holds, so a cache that kept num_heads heads
fails), the counts shrink with the key/value heads, and bad arguments are one line with exit 2.
"""

from __future__ import annotations

import json

import pytest

from parity_tests.bench.test_bench import INSTALLED, one_torch_thread  # noqa: F401
from transformer_rosetta.benchmarks import bench_kv_heads


@pytest.mark.parametrize("framework", bench_kv_heads.FRAMEWORKS)
def test_every_framework_caches_key_value_heads_only(framework, capsys, one_torch_thread):  # noqa: F811
    if framework not in INSTALLED:
        pytest.skip(f"{framework} is not installed")
    argv = ["--frameworks", framework, "--size", "tiny", "--kv-heads", "8", "2", "1"]
    argv += ["--batch", "2", "--prompt-len", "3", "--new-tokens", "4", "--repeats", "1"]
    assert bench_kv_heads.main([*argv, "--device", "cpu", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    # tiny_llama: 2 layers, d_k = 32 / 8 = 4, float32: 2 * 2 * g * 4 * 4 = 64 g bytes a token.
    assert r["cache_bytes_per_token"] == {"kv8": 512.0, "kv2": 128.0, "kv1": 64.0}
    assert r["spec_cache_bytes_per_token"] == {"kv8": 512, "kv2": 128, "kv1": 64}
    assert r["parameters"]["kv8"] > r["parameters"]["kv2"] > r["parameters"]["kv1"]
    assert r["ratio_to_multi_head"]["kv8"] == 1.0
    assert all(v > 0 for v in r["tokens_per_s"].values())


def test_a_head_count_that_does_not_divide_is_refused(capsys):
    assert bench_kv_heads.main(["--kv-heads", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--kv-heads: 3 does not divide the 8 query heads; use 8, 4, 2 or 1" in err[0]
