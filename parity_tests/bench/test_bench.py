"""The benchmarks' plumbing: `rosetta bench` (run_bench), benchmarks/bench_train.py and
benchmarks/bench_decode.py on tiny presets, for the structure only.

Speed is never asserted in a test (a shared CI machine makes any threshold flaky): these check the
shape of the result, that every time is positive and every ratio finite, that progress is
reported, that a framework that cannot run is skipped with its reason, that --device and
--precision are parsed, reach every contender (the peers too) and are refused in one line with
exit 2 when wrong, that the JSON names the device and the precision, and that every framework's
peer holds our weights and gives our logits before it is timed: a peer computing another
function (one weight perturbed) or a config it cannot express is refused in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math

import pytest

from transformer_rosetta.adapter.backends import get_backend, unavailable_reason
from transformer_rosetta.benchmarks import harness, suite
from transformer_rosetta.cli import main as rosetta
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.tolerances import atol_for

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
        device="cpu",
    )
    return result, messages


@pytest.fixture
def one_torch_thread():
    """torch on one thread for a plumbing test: on a shared 2-core machine, torch's second OpenMP
    thread waits on cores that JAX's and TensorFlow's thread pools (loaded by earlier tests)
    hold, which makes tiny runs tens of times slower. Timings are not what these tests check."""
    if "torch" not in INSTALLED:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sees_a_gpu(framework: str) -> bool:
    return any(d != "cpu" for d in get_backend(framework).devices())


def test_every_installed_framework_is_measured_and_the_rest_skipped_with_a_reason(bench):
    result, _ = bench
    assert list(result["results"]) == INSTALLED
    assert result["target"] == 1.15
    assert (result["precision"], result["dtype"]) == ("highest", "float32")
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
    assert set(r["tflops"]) == keys
    assert all(r["tflops"][k] == pytest.approx(r["gflops"][k] / 1e3) for k in keys)
    assert r["device"] == "cpu" and r["device_name"] == harness.cpu_name() and r["device_name"]
    assert (r["precision"], r["dtype"], r["matmul_precision"]) == ("highest", "float32", "highest")
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
    assert (w["device"], w["dtype"], w["matmul_n"]) == ("cpu", "float32", 2048)


def test_jax_peer_holds_our_weights_and_gives_our_logits(bench):
    if "jax" not in INSTALLED:
        pytest.skip(f"jax: {unavailable_reason('jax')}")
    gap = bench[0]["results"]["jax"]["max_abs_logit_gap_vs_peer"]
    # The same function in float32, up to summation order (tiny logits are O(1)).
    assert gap is not None and gap < 1e-5


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_every_peer_holds_our_weights_and_gives_our_logits(bench, framework):
    if framework not in INSTALLED:
        pytest.skip(f"{framework}: {unavailable_reason(framework)}")
    r = bench[0]["results"][framework]
    # Twice the float32 bound of the parity suite (harness.peer_bound), and met well inside it.
    assert r["logit_gap_bound"] == 2 * atol_for("float32", preset("tiny")) == 2e-5
    assert r["max_abs_logit_gap_vs_peer"] <= r["logit_gap_bound"] / 4
    assert f"(bound {r['logit_gap_bound']:.1e})" in suite.format_bench(bench[0])


def test_progress_names_each_framework_and_repeat(bench):
    _, messages = bench
    for name in INSTALLED:
        assert f"{name}: repeat {REPEATS}/{REPEATS}" in messages
    assert any(m.startswith("numpy: skipped") for m in messages)


def test_format_bench_prints_times_ratio_target_and_matmul_fraction(bench):
    text = suite.format_bench(bench[0])
    for name in INSTALLED:
        r = bench[0]["results"][name]
        assert f"{name}: {r['version']} on cpu ({r['device_name']})" in text
        assert f"ratio ours/peer {r['ratio']:.3f} (target <= 1.15: " in text
    assert text.count("(ceiling)") == len(INSTALLED)
    assert text.count("% of matmul") == 3 * len(INSTALLED)
    assert text.count("TFLOP/s") == 4 * len(INSTALLED)
    assert "float32 (precision highest)" in text
    assert "numpy: skipped (" in text


def test_alternate_takes_one_sample_per_round_after_the_warmup():
    calls: list[str] = []
    messages: list[str] = []
    contenders = {k: (lambda k=k: calls.append(k)) for k in ("a", "b")}
    times = harness.alternate("x", contenders, repeats=3, warmup=2, progress=messages.append)
    assert calls == ["a", "b"] * 5  # 2 warm-up rounds, then 3 timed rounds, in alternation
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert messages[-1] == "x: repeat 3/3" and len(messages) == 4
    with pytest.raises(ValueError, match="repeats"):
        harness.alternate("x", contenders, repeats=0, warmup=0, progress=None)


def test_module_main_prints_json_or_the_report(bench, capsys):
    if not INSTALLED:
        pytest.skip("no framework installed")
    name = INSTALLED[0]
    canned = bench[0]["results"][name]
    seen: list[tuple] = []

    def measure(config, batch, src_len, tgt_len, repeats, progress, *, device, precision):
        seen.append((config.d_model, batch, src_len, tgt_len, repeats, progress, device, precision))
        return canned

    argv = ["--repeats", "2", "--json", "--device", "cpu", "--precision", "tf32"]
    assert suite.module_main(name, measure, argv, 7, "d") is canned
    assert json.loads(capsys.readouterr().out)["ratio"] == pytest.approx(canned["ratio"])
    # the issues' workload, silent under --json
    assert seen[-1] == (512, 8, 128, 128, 2, None, "cpu", "tf32")
    suite.module_main(name, measure, ["--device", "cpu"], 7, "d")
    assert "ratio ours/peer" in capsys.readouterr().out
    assert seen[-1][4] == 7 and seen[-1][5] is not None and seen[-1][7] == "highest"
    with pytest.raises(SystemExit) as stopped:
        suite.module_main(name, measure, ["--precision", "fp8"], 7, "d")
    assert stopped.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# -- devices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "request_", "expected"),
    [
        (["cpu"], "auto", "cpu"),
        (["cpu", "cuda:0", "cuda:1"], "auto", "cuda:0"),
        (["cpu", "gpu:0"], "cpu", "cpu"),
        (["cpu", "gpu:0", "gpu:1"], "gpu", "gpu:0"),
        (["cpu", "cuda:0", "cuda:1"], "gpu:1", "cuda:1"),  # the N-th GPU in every framework
        (["cpu", "gpu:0", "gpu:1"], "cuda:1", "gpu:1"),
        (["cpu", "cuda:0"], "cuda:1", None),
        (["cpu"], "gpu", None),
        (["cpu", "mps"], "auto", "cpu"),  # only GPUs count
    ],
)
def test_resolve_device_names_each_frameworks_own_device(visible, request_, expected):
    assert harness.resolve_device(visible, request_) == expected


@pytest.mark.parametrize("text", ["tpu", "cuda:x", "gpu:-1", "", "cpu0"])
def test_device_arg_refuses_an_unknown_device(text):
    with pytest.raises(Exception, match="unknown device"):
        harness.device_arg(text)


def one_line_exit_2(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "cuda:"], "unknown device"),
        (["--precision", "fp16"], "--precision"),
        (["--precision", "bf16", "--repeats", "0"], "--repeats"),
        (["--preset", "tiny_decoder_only"], "this model is decoder-only, which has no peer here"),
        (["--preset", "tiny_encoder_only"], "this model is encoder-only, which has no peer here"),
    ],
)
def test_rosetta_bench_refuses_bad_arguments_in_one_line(capsys, argv, says):
    err = one_line_exit_2(capsys, rosetta(["bench", "--preset", "tiny", *argv]))
    assert says in err


def test_rosetta_bench_device_gpu_without_a_gpu_is_one_line_exit_2(capsys):
    if "torch" not in INSTALLED:
        pytest.skip(f"torch: {unavailable_reason('torch')}")
    if sees_a_gpu("torch"):
        pytest.skip("torch sees a GPU here")
    code = rosetta(["bench", "--preset", "tiny", "--frameworks", "torch", "--device", "gpu"])
    err = one_line_exit_2(capsys, code)
    assert "--device gpu" in err and "torch sees cpu" in err


def test_help_documents_device_auto_and_the_precisions(capsys):
    with pytest.raises(SystemExit):
        rosetta(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "auto (the default: the framework's first GPU if it sees one, else the cpu)" in out
    assert "highest,tf32,bf16" in out


# -- precision reaches ours, the peer and the matmul ------------------------------------------


class PrecisionSpy:
    """Stands for a framework's matmul_precision: records each mode entered and which is active."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.active: list[str] = []

    @contextlib.contextmanager
    def __call__(self, precision: str = "highest"):
        self.entered.append(precision)
        self.active.append(precision)
        try:
            yield
        finally:
            self.active.pop()

    def now(self) -> str | None:
        return self.active[-1] if self.active else None


@pytest.mark.parametrize(
    ("precision", "dtype", "mode"), [("tf32", "float32", "tf32"), ("bf16", "bfloat16", "highest")]
)
def test_torch_ours_peer_and_matmul_run_at_the_precision_asked_for(
    monkeypatch, precision, dtype, mode, one_torch_thread
):
    if "torch" not in INSTALLED:
        pytest.skip(f"torch: {unavailable_reason('torch')}")
    from transformer_rosetta.benchmarks import bench_torch_impl_forward as bench_torch

    spy, seen = PrecisionSpy(), []
    monkeypatch.setattr(bench_torch, "matmul_precision", spy)
    monkeypatch.setattr(bench_torch, "matmul_size", lambda device, dtype: 64)
    peer_forward = bench_torch.Peer.forward

    def forward(self, src, tgt_in):
        seen.append((spy.now(), str(self.output.weight.dtype)))
        return peer_forward(self, src, tgt_in)

    monkeypatch.setattr(bench_torch.Peer, "forward", forward)
    built = []
    backend = get_backend("torch")
    build = backend.build
    monkeypatch.setattr(
        backend,
        "build",
        lambda *a, **k: built.append((k["dtype"], k["precision"])) or build(*a, **k),
    )
    r = bench_torch.measure(preset("tiny"), BATCH, LENGTH, LENGTH, 1, precision=precision)
    assert spy.entered == [mode]  # bf16 is a dtype: its products are bf16 whatever the mode
    # the check against our logits, 2 warm-up rounds and 1 timed, every one under the switch, in
    # the dtype asked for
    assert seen == [(mode, f"torch.{dtype}")] * 4
    assert built == [(dtype, mode)]  # ours gets both from the adapter
    assert (r["precision"], r["dtype"], r["matmul_precision"]) == (precision, dtype, mode)
    assert r["contenders"]["matmul"] == f"matmul 64x64 {dtype}"


@pytest.mark.slow  # jit compiles three programs: about 10 s on 2 cores
def test_jax_bf16_reaches_ours_the_peer_and_the_matmul(monkeypatch):
    if "jax" not in INSTALLED:
        pytest.skip(f"jax: {unavailable_reason('jax')}")
    import jax.numpy as jnp

    from transformer_rosetta.benchmarks import bench_jax_impl_forward as bench_jax

    spy, traced = PrecisionSpy(), []
    monkeypatch.setattr(bench_jax, "matmul_precision", spy)
    monkeypatch.setattr(bench_jax, "matmul_size", lambda device, dtype: 64)
    peer_call = bench_jax.Peer.__call__

    def call(self, src, tgt_in):
        traced.append((spy.now(), self.embed.embedding[...].dtype))
        return peer_call(self, src, tgt_in)

    monkeypatch.setattr(bench_jax.Peer, "__call__", call)
    r = bench_jax.measure(preset("tiny"), BATCH, LENGTH, LENGTH, 1, precision="bf16")
    assert spy.entered == ["highest"]  # bf16 is a dtype: its products are bf16 whatever the mode
    assert traced and all(t == ("highest", jnp.bfloat16) for t in traced)
    assert (r["precision"], r["dtype"]) == ("bf16", "bfloat16")
    assert r["contenders"]["matmul"] == "matmul 64x64 bfloat16" and r["workload"]["matmul_n"] == 64
    json.dumps(r)


# -- every peer computes our function, or gets no ratio ----------------------------------------


def perturb_one_weight(
    monkeypatch, module, name: str = "decoder.layers.1.feed_forward.output.bias"
):
    """Give the module's peer (its peer_from_canonical) our weights but one element of `name`,
    which moves by 0.01: a peer computing another function, however slightly."""
    build = module.peer_from_canonical

    def peer_from_canonical(config, weights, *args, **kwargs):
        changed = weights[name].copy()
        changed.flat[0] += 0.01
        return build(config, {**weights, name: changed}, *args, **kwargs)

    monkeypatch.setattr(module, "peer_from_canonical", peer_from_canonical)


@pytest.mark.parametrize(
    "framework",
    [
        "torch",
        # XLA compiles ours and the peer before the check: about 9 s on 2 cores
        pytest.param("tf", marks=pytest.mark.slow),
        "jax",
    ],
)
def test_a_peer_computing_another_function_is_refused_in_one_line_before_timing(
    monkeypatch, framework, one_torch_thread
):
    reason = harness.bench_unavailable_reason(framework)
    if reason is not None:
        pytest.skip(f"{framework}: {reason}")
    module = importlib.import_module(suite.MODULES[framework])
    perturb_one_weight(monkeypatch, module)
    messages: list[str] = []
    with pytest.raises(harness.PeerDiffers) as refused:
        module.measure(preset("tiny"), BATCH, LENGTH, LENGTH, REPEATS, messages.append)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("the peer computes a different function: max |logits ours - peer| ")
    assert "above 2.0e-05 (twice the float32 bound" in message and "no ratio" in message
    assert not any("warm-up" in m or "repeat" in m for m in messages)  # nothing was timed


def test_rosetta_bench_skips_a_differing_peer_with_the_reason_and_exits_1(
    capsys, monkeypatch, one_torch_thread
):
    if "torch" not in INSTALLED:
        pytest.skip(f"torch: {unavailable_reason('torch')}")
    from transformer_rosetta.benchmarks import bench_torch_impl_forward as bench_torch

    perturb_one_weight(monkeypatch, bench_torch)
    argv = ["bench", "--preset", "tiny", "--frameworks", "torch", "--device", "cpu"]
    argv += ["--batch", str(BATCH), "--src-len", str(LENGTH), "--tgt-len", str(LENGTH)]
    assert rosetta([*argv, "--repeats", "1", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["results"] == {} and result["peer_differs"] == ["torch"]
    assert result["skipped"]["torch"].startswith("the peer computes a different function")
    assert rosetta([*argv, "--repeats", "1"]) == 1
    assert "torch: skipped (the peer computes a different function: " in capsys.readouterr().out


def test_module_main_refuses_a_differing_peer_in_one_line_exit_1(capsys):
    def measure(config, batch, src_len, tgt_len, repeats, progress, *, device, precision):
        raise harness.PeerDiffers("the peer computes a different function: (canned)")

    with pytest.raises(SystemExit) as stopped:
        suite.module_main("torch", measure, ["--device", "cpu"], 7, "d")
    assert stopped.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        "the peer computes a different function: (canned)"
    )


def test_a_config_beyond_a_peer_is_skipped_with_what_the_peer_lacks(one_torch_thread):
    # nn.Transformer expresses pre-norm layers with final norms and GELU (and so holds and
    # matches our weights); the Keras and Flax peers are the paper's post-norm ReLU layers.
    config = preset("tiny").replace(norm_position="pre", final_norm=True, activation="gelu")
    result = suite.run_bench(
        list(IMPLEMENTATIONS), config, BATCH, LENGTH, LENGTH, REPEATS, device="cpu"
    )
    assert result["peer_differs"] == []
    if "torch" in INSTALLED:
        r = result["results"]["torch"]
        assert r["max_abs_logit_gap_vs_peer"] <= r["logit_gap_bound"]
    for name in ("tf", "jax"):
        if name in INSTALLED:
            reason = result["skipped"][name]
            assert reason.startswith("its peer cannot compute this config's function: ")
            assert "pre-norm layers" in reason and "a final LayerNorm" in reason
            assert "activation gelu" in reason and "\n" not in reason


def test_what_no_peer_can_express_is_named():
    config = preset("tiny").replace(position_kind="learned", scale_embeddings=False)
    lacks = harness.lacked_by_every_peer(config)
    assert lacks == [
        "learned positions (each peer adds sinusoids)",
        "unscaled embeddings (each peer scales them by sqrt(d_model))",
    ]
    assert harness.lacked_by_every_peer(preset("tiny")) == []
    assert harness.lacked_by_the_paper_layers(preset("base")) == []
    with pytest.raises(harness.PeerRefused, match="learned positions"):
        harness.measure(
            harness.ForwardHook(  # never built: the config is refused first
                framework="x",
                version="",
                peer="",
                labels={},
                warmup=0,
                peer_lacks=lambda c: [],
                build=None,  # type: ignore[arg-type]
                running=None,  # type: ignore[arg-type]
                workload=None,  # type: ignore[arg-type]
            ),
            config,
            BATCH,
            LENGTH,
            LENGTH,
            REPEATS,
        )


# -- bench_train ------------------------------------------------------------------------------

TINY_BASE = [
    "--preset",
    "tiny",
    "--vocab",
    "64",
    "--batch",
    "2",
    "--src-len",
    "8",
    "--tgt-len",
    "8",
]
ONE_ROUND = ["--steps", "1", "--repeats", "1", "--device", "cpu", "--json"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "tpu"], "unknown device"),
        (["--precision", "int8"], "--precision"),
        (["--workload", "numbers", "--preset", "tiny"], "--preset: only for --workload base"),
        (["--workload", "big"], "--workload"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bench_train_refuses_bad_arguments_in_one_line(capsys, argv, says):
    from transformer_rosetta.benchmarks import bench_train

    assert says in one_line_exit_2(capsys, bench_train.main(argv))


def test_bench_train_device_gpu_without_a_gpu_is_one_line_exit_2(capsys):
    if "jax" not in INSTALLED:
        pytest.skip(f"jax: {unavailable_reason('jax')}")
    if sees_a_gpu("jax"):
        pytest.skip("jax sees a GPU here")
    from transformer_rosetta.benchmarks import bench_train

    err = one_line_exit_2(capsys, bench_train.main(["--frameworks", "jax", "--device", "gpu"]))
    assert "--device gpu" in err


def test_bench_train_numbers_reports_tokens_per_second_against_torch(capsys, one_torch_thread):
    if "torch" not in INSTALLED:
        pytest.skip(f"torch: {unavailable_reason('torch')}")
    from transformer_rosetta.benchmarks import bench_train

    assert bench_train.main(["--frameworks", "torch", *ONE_ROUND]) == 0
    result = json.loads(capsys.readouterr().out)
    w = result["workload"]
    assert w["name"] == "numbers"  # the default on a CPU
    assert (w["task"], w["batch"], w["precision"], w["dtype"]) == (
        "numbers",
        64,
        "highest",
        "float32",
    )
    assert result["target"] == {"ratio_to_torch": 0.8}
    r = result["results"]["torch"]
    assert r["device"] == "cpu" and r["device_name"] == harness.cpu_name()
    assert r["tokens_per_s"] == pytest.approx(w["target_tokens_per_round"] / r["median_s"])
    assert math.isfinite(r["last_loss"])
    assert r["ratio_to_torch"] == 1.0 and "target_met" not in r  # the target is tf's and jax's


@pytest.mark.parametrize(
    "framework",
    [
        "torch",
        # XLA compiles ours and the peer's training steps: tens of seconds on 2 cores
        pytest.param("tf", marks=pytest.mark.slow),
        pytest.param("jax", marks=pytest.mark.slow),
    ],
)
def test_bench_train_base_times_ours_and_the_peer_at_the_precision_asked_for(
    capsys, monkeypatch, framework, one_torch_thread
):
    reason = harness.bench_unavailable_reason(framework)
    if reason is not None:
        pytest.skip(f"{framework}: {reason}")
    from transformer_rosetta.benchmarks import bench_train

    spy, seen = PrecisionSpy(), []
    monkeypatch.setattr(bench_train, "framework_precision", lambda name, mode: spy(mode))
    make_peer = bench_train.PEERS[framework]

    def peer(*args):
        run = make_peer(*args)
        return lambda batches: seen.append(spy.now()) or run(batches)

    monkeypatch.setattr(bench_train, "PEERS", {**bench_train.PEERS, framework: peer})
    argv = ["--frameworks", framework, "--precision", "tf32", *TINY_BASE, *ONE_ROUND]
    assert bench_train.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    w = result["workload"]
    assert w["name"] == "base"  # implied by the base-only options
    assert (w["batch"], w["src_len"], w["tgt_len"], w["tgt_vocab"]) == (2, 8, 8, 64)
    assert w["target_tokens_per_round"] == 2 * 8 and w["padding"] == "none"
    assert (w["precision"], w["dtype"], w["matmul_precision"]) == ("tf32", "float32", "tf32")
    r = result["results"][framework]
    assert r["device"] == "cpu" and r["device_name"]
    assert set(r["tokens_per_s"]) == set(r["tflops"]) == {"ours", "peer"}
    assert all(t > 0 and math.isfinite(t) for t in r["tokens_per_s"].values())
    assert all(math.isfinite(loss) for loss in r["last_loss"].values())
    assert r["ratio_to_peer"] == pytest.approx(
        r["tokens_per_s"]["ours"] / r["tokens_per_s"]["peer"]
    )
    assert seen == ["tf32"] * 4  # warm-up rounds (3 steps of 1) and the timed one
    assert spy.entered == ["tf32"]


# -- bench_decode -----------------------------------------------------------------------------


def test_bench_decode_names_device_and_precision(capsys, one_torch_thread):
    if "torch" not in INSTALLED:  # no compilation (JAX's uncached path compiles every length)
        pytest.skip(f"torch: {unavailable_reason('torch')}")
    from transformer_rosetta.benchmarks import bench_decode

    argv = ["--frameworks", "torch", "--preset", "tiny", "--batch", "2", "--new-tokens", "52"]
    assert bench_decode.main([*argv, "--repeats", "1", "--device", "cpu", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert (r["device"], r["device_name"]) == ("cpu", harness.cpu_name())
    assert (r["precision"], r["dtype"]) == ("highest", "float32")
    assert r["same_tokens"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "cuda:x"], "unknown device"),
        (["--precision", "fp8"], "--precision"),
        (["--new-tokens", "50"], "--new-tokens"),
    ],
)
def test_bench_decode_refuses_bad_arguments_in_one_line(capsys, argv, says):
    from transformer_rosetta.benchmarks import bench_decode

    assert says in one_line_exit_2(capsys, bench_decode.main(argv))
