"""torch on many processes (torch_impl/distributed.py): DDP and FSDP2 over gloo, checked against
the one-device backend and the float64 oracle.

The runs happen in subprocesses (torch_mesh_worker.py): one `local` worker starts a job of 2
ranks that trains and runs every case, a job whose rank 1 raises, and the public functions; one
`torchrun` worker runs the public functions under torchrun. The config is the pairwise grid's
"shared" one: one embedding table for both stacks that is also the output projection (FSDP2 must
keep it one tensor), the Annotated Transformer's norm, dropout 0 (dropout's masks depend on
how the batch is split), no attention biases. A key bias is left out on purpose: its true
gradient is exactly 0 and each run hands Adam different rounding noise of ~1e-17, which Adam
scales to steps of ~lr (parity_tests/impl/test_training.py says more), so no two summation
orders agree on it. The batches are ragged: the two data replicas hold different numbers of
non-pad targets in every step (asserted), which is what makes the per-replica mean wrong.

Bounds (the figures measured on the CPU, gloo, 2 ranks):
- float64: 1e-12 on every loss and final weight, the issue's bound. Both runs compute the same
  sums in another order (each replica's half of the batch, then the engine's mean), ~1e-16
  relative on a gradient; Adam normalises the gradient, so a relative change d in it moves a
  weight by at most ~lr * d a step, and 20 steps (sum of the Noam rates 1.25) keep that near
  1e-15. Measured: data=2 losses 1.3e-15, weights 2.4e-15; model=2 losses 4.4e-16, weights 0
  (each rank runs the same rows through the same gathered layers; only the losses' all-reduce
  rounds); data=2 x model=2 (slow) the same as data=2.
- float32: let e be how far one float32 run ends from its own float64 run after these 20 steps:
  the one-device run on this config measures 6.4e-7 on losses and 1.3e-6 on weights
  (parity_tests/impl/test_training.py measured up to 8.7e-7 on losses on its configs). Two
  float32 runs that order their sums differently each stay within e of the float64 trajectory,
  in either direction, so they may differ by 2e: 1.7e-6 on losses, 2.6e-6 on weights. The bounds
  are 5e-6 for both, about twice that (and test_training's LOSS_ATOL_F32 between frameworks, for
  the same reason); the trap below moves the weights by 1.0. Measured: data=2 losses 7.2e-7,
  weights 1.6e-6; model=2 losses 2.4e-7, weights 0.
- the forward against the oracle: transformer_rosetta.spec.tolerances.atol_for(dtype, config),
  the bound of every forward parity test. Measured: 2.0e-15 (float64), 9.1e-7 (float32).
- the trap, each replica dividing by its own token count: measured 0.046 on the first step's loss,
  0.24 on the losses, 1.0 on the weights; asserted above TRAP_MIN_GAP = 1e-6.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip, import_or_skip
from parity_tests.distributed.cases import (
    CONFIG,
    F64_ATOL,
    ROWS,
    TRAP_MIN_GAP,
    WARMUP,
    global_batch,
    max_diff,
    weight_diff,
    write_worker_inputs,
)
from parity_tests.paths import ROOT
from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.mesh import MeshShape, replica_rows, target_tokens
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights
from transformer_rosetta.weights.init import init_weights

distributed = import_or_skip("transformer_rosetta.torch_impl.distributed", "torch is not installed")

LOSS_ATOL_F32 = 5e-6
WEIGHT_ATOL_F32 = 5e-6
DATA_2 = MeshShape(data=2)


def run_worker(args: list[str], inputs: Path, tmp: Path) -> dict[str, np.ndarray]:
    out = tmp / "out.npz"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(
        [sys.executable, *args, str(inputs), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.fail(f"the worker failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The inputs, written for the workers, and the one-device runs every case is checked on."""
    backend = backend_or_skip("torch")
    tmp = tmp_path_factory.mktemp("torch_mesh")
    case = write_worker_inputs(
        tmp,
        checkpoint=tmp / "model2.safetensors",
        failed_checkpoint=tmp / "failed.safetensors",
    )
    weights, batches = case["weights"], case["batches"]
    one_device = {}
    for dtype in ("float64", "float32"):
        model = backend.build(CONFIG, weights, dtype=dtype)
        losses = model.train_steps(batches, warmup=WARMUP)
        one_device[dtype] = (np.array(losses), model.export())
    return {**case, "one_device": one_device}


@pytest.fixture(scope="module")
def local(case):
    return run_worker(
        ["-m", "parity_tests.distributed.torch_mesh_worker", "local"], case["inputs"], case["tmp"]
    )


def assert_trains_as_one_device(local: dict, case: dict, axis: str, dtype: str) -> None:
    """The run on 2 ranks along `axis` ("data" or "model"): both ranks hold the same weights, to
    the bit, and its losses and weights are the one-device run's within the bound of `dtype`."""
    prefix = f"{axis}{dtype[-2:]}"  # data64, model32, ...
    want_losses, want = case["one_device"][dtype]
    for name in want:
        np.testing.assert_array_equal(
            local[f"rank0:{prefix}:w:{name}"], local[f"rank1:{prefix}:w:{name}"]
        )
    loss_gap = max_diff(local[f"rank0:{prefix}:losses"], want_losses)
    weight_gap = weight_diff(local, f"rank0:{prefix}", want)
    losses_atol, weights_atol = (
        (F64_ATOL, F64_ATOL) if dtype == "float64" else (LOSS_ATOL_F32, WEIGHT_ATOL_F32)
    )
    assert loss_gap <= losses_atol, f"{dtype} losses off by {loss_gap:.3g}"
    assert weight_gap <= weights_atol, f"{dtype} weights off by {weight_gap:.3g}"
    print(f"{axis}=2 {dtype}: losses {loss_gap:.3g}, weights {weight_gap:.3g}")


def test_the_batches_put_different_token_counts_on_the_replicas(case):
    for _, tgt in case["batches"]:
        counts = [target_tokens(tgt[replica_rows(ROWS, 2, r)], CONFIG.pad_id) for r in range(2)]
        assert counts[0] != counts[1], counts


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_data_parallel_equals_one_device(local, case, dtype):
    # DDP leaves every rank with the same weights, to the bit.
    assert_trains_as_one_device(local, case, "data", dtype)


def test_the_per_replica_mean_is_the_trap(local, case):
    """Each replica dividing by its own token count (the engine then averaging) trains on another
    loss: far from one device, where the global-count scaling agrees to 1e-12."""
    want_losses, want = case["one_device"]["float64"]
    naive_loss = max_diff(local["rank0:naive64:losses"], want_losses)
    naive_weights = weight_diff(local, "rank0:naive64", want)
    first_step = abs(float(local["rank0:naive64:losses"][0]) - float(want_losses[0]))
    print(
        f"naive per-replica mean, float64: step-1 loss {first_step:.3g}, losses {naive_loss:.3g}, weights {naive_weights:.3g}"
    )
    assert first_step > TRAP_MIN_GAP and naive_weights > TRAP_MIN_GAP
    assert weight_diff(local, "rank0:data64", want) <= F64_ATOL


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sharded_training_equals_one_device(local, case, dtype):
    """FSDP2 over 2 ranks trains as one device does. This also shows that FSDP2 kept the shared
    embedding one tensor: split into copies, each would be trained by one use's gradient instead
    of the sum of its three (source and target embedding, output projection), and the canonical
    tensor would move away from the one-device run's by far more than the bound."""
    # Every rank gathers the same whole weights.
    assert_trains_as_one_device(local, case, "model", dtype)


def test_the_parameters_really_are_sharded(local):
    """FSDP2 splits dim 0 of every parameter over the 2 ranks, padding the last shard: a 20-row
    feed-forward kernel (nn.Linear's (out, in) layout) is 10 rows on each rank, the 23-row shared
    embedding 12 rows on rank 0 and 11 on rank 1, and the tied output projection is that same
    shard."""
    ff = "encoder.layers.0.feed_forward.intermediate.weight"
    for rank in (0, 1):
        assert tuple(local[f"rank{rank}:shard:{ff}"]) == (CONFIG.d_ff // 2, CONFIG.d_model)
    emb = [tuple(local[f"rank{r}:shard:encoder.embedding.weight"]) for r in (0, 1)]
    assert emb == [(12, CONFIG.d_model), (11, CONFIG.d_model)]
    for rank in (0, 1):
        assert tuple(local[f"rank{rank}:shard:output.weight"]) == emb[rank]
        assert tuple(local[f"rank{rank}:shard:decoder.embedding.weight"]) == emb[rank]


@pytest.mark.parametrize(
    ("key", "dtype"),
    [("fwd_model64", "float64"), ("fwd_model32", "float32"), ("fwd_data64", "float64")],
)
def test_the_forward_on_the_mesh_gives_the_oracles_logits_and_attention(local, case, key, dtype):
    want = reference.forward(case["weights"], CONFIG, *case["fwd"]).named()
    found = {k.split(":", 2)[2]: v for k, v in local.items() if k.startswith(f"rank0:{key}:")}
    assert "logits" in found and "decoder.layers.0.cross_attention" in found
    assert set(found) <= set(want)
    worst = max(max_diff(found[name], want[name]) for name in found)
    print(f"{key}: {worst:.3g} from the oracle ({len(found)} outputs)")
    assert worst <= atol_for(dtype, CONFIG)


def test_the_public_functions_and_the_sharded_checkpoint(local, case):
    """train_on_mesh and forward_on_mesh as a caller runs them (rank 0's results), and the sharded
    run's weights written as the shared format: any framework loads them at any device count."""
    want_losses, want = case["one_device"]["float64"]
    assert max_diff(local["public_model64:losses"], want_losses) <= F64_ATOL
    assert weight_diff(local, "public_model64", want) <= F64_ATOL
    oracle = reference.forward(case["weights"], CONFIG, *case["fwd"]).named()
    fwd = {k.split(":", 1)[1]: v for k, v in local.items() if k.startswith("public_fwd_data64:")}
    assert max(max_diff(fwd[n], oracle[n]) for n in fwd) <= atol_for("float64")
    saved = load_weights(case["tmp"] / "model2.safetensors", CONFIG)
    assert list(saved.tensors) == list(canonical_shapes(CONFIG))
    for name, t in saved.tensors.items():
        np.testing.assert_array_equal(t, local[f"public_model64:w:{name}"])
    src, tgt = case["batches"][0]
    tgt_in = shift_right(tgt, CONFIG.bos_id)
    one = backend_or_skip("torch").build(CONFIG, dict(saved.tensors), dtype="float64")
    trained = reference.forward(dict(saved.tensors), CONFIG, src, tgt_in)
    assert max_diff(one.forward(src, tgt_in).logits, trained.logits) <= atol_for("float64")


def test_a_rank_that_raises_stops_the_run_with_one_line(local, case):
    message = str(local["failure"])
    print(f"rank failure after {float(local['time:failure']):.1f} s: {message}")
    assert message.startswith("rank 1 of 2 failed: ValueError: injected fault at step 3"), message
    assert "\n" not in message
    # The agent ends rank 0 when rank 1 exits: no waiting for the collective timeout.
    assert float(local["time:failure"]) < distributed.COLLECTIVE_TIMEOUT.total_seconds()
    assert not (case["tmp"] / "failed.safetensors").exists()


def test_under_torchrun(case, tmp_path):
    """The same module in the processes torchrun starts: each calls train_on_mesh and
    forward_on_mesh, which run their own rank instead of launching."""
    found = run_worker(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",  # torchrun's error files, in the test's folder rather than /tmp
            str(tmp_path / "torchrun-logs"),
            str(ROOT / "parity_tests" / "distributed" / "torch_mesh_worker.py"),
            "torchrun",
        ],
        case["inputs"],
        tmp_path,
    )
    want_losses, want = case["one_device"]["float64"]
    assert max_diff(found["torchrun_data64:losses"], want_losses) <= F64_ATOL
    assert weight_diff(found, "torchrun_data64", want) <= F64_ATOL
    oracle = reference.forward(case["weights"], CONFIG, *case["fwd"]).named()
    fwd = {k.split(":", 1)[1]: v for k, v in found.items() if k.startswith("torchrun_fwd:")}
    assert fwd and max(max_diff(fwd[n], oracle[n]) for n in fwd) <= atol_for("float64")


# -- checks before anything starts ----------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """A launch, or a rank's work, fails the test: each check must refuse before anything
    starts. The machine has 2 devices."""

    def launched(*args, **kwargs):
        raise AssertionError("work started")

    for name in ("launch_local", "train_rank", "forward_rank"):
        monkeypatch.setattr(distributed, name, launched)
    monkeypatch.setattr(distributed, "available_devices", lambda: 2)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_a_mesh_needing_more_devices_is_refused_before_work(no_launch):
    weights = init_weights(CONFIG, seed=0, scheme="perturbed", dtype="float64")
    batches = [global_batch(0)]
    six = [tuple(np.concatenate([a, a[:2]]) for a in global_batch(0))]
    with pytest.raises(
        InputError,
        match=r"^--mesh data=3,model=1: the mesh data=3,model=1 needs 3 devices, and 2 are available$",
    ):
        distributed.train_on_mesh(
            CONFIG, weights, six, MeshShape(data=3), dtype="float64", warmup=WARMUP
        )
    with pytest.raises(InputError, match="num_heads=2 does not divide over model=4 shards"):
        distributed.forward_on_mesh(CONFIG, weights, *batches[0], MeshShape(model=4))
    with pytest.raises(InputError, match="the batch of 4 rows does not divide over data=3"):
        distributed.train_on_mesh(CONFIG, weights, batches, MeshShape(data=3), warmup=WARMUP)
    with pytest.raises(InputError, match="a mesh run takes float32 or float64"):
        distributed.train_on_mesh(
            CONFIG, weights, batches, MeshShape(data=2), dtype="bfloat16", warmup=WARMUP
        )


def test_under_torchrun_the_mesh_must_match_its_processes(no_launch, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rosetta-test")
    monkeypatch.setenv("WORLD_SIZE", "3")
    weights = init_weights(CONFIG, seed=0, scheme="perturbed", dtype="float64")
    with pytest.raises(
        InputError, match=r"^--mesh data=2,model=1: needs 2 processes, and torchrun started 3$"
    ):
        distributed.train_on_mesh(CONFIG, weights, [global_batch(0)], DATA_2, warmup=WARMUP)


@pytest.mark.slow
def test_hsdp_on_a_two_by_two_mesh(case, tmp_path):
    """data=2 x model=2 (HSDP: replicated over data, sharded over model) needs 4 processes, more
    than the CI machine's 2 cores hold at speed: slow."""
    found = run_worker(
        ["-m", "parity_tests.distributed.torch_mesh_worker", "hsdp"], case["inputs"], tmp_path
    )
    want_losses, want = case["one_device"]["float64"]
    loss_gap, weight_gap = (
        max_diff(found["hsdp64:losses"], want_losses),
        weight_diff(found, "hsdp64", want),
    )
    print(f"data=2 x model=2 float64: losses {loss_gap:.3g}, weights {weight_gap:.3g}")
    assert loss_gap <= F64_ATOL and weight_gap <= F64_ATOL


def test_ddp_skips_the_forward_buffer_sync_under_either_torch_name():
    """torch 2.13 calls it forward_sync_buffers; the GPU image's torch 2.11 knows only
    broadcast_buffers (bench_scale's mesh engine failed there with a TypeError on the new name)."""

    class Ddp213:
        def __init__(self, module, broadcast_buffers=None, forward_sync_buffers=None): ...

    class Ddp211:
        def __init__(self, module, broadcast_buffers=True): ...

    assert distributed.no_forward_buffer_sync(Ddp213) == {"forward_sync_buffers": False}
    assert distributed.no_forward_buffer_sync(Ddp211) == {"broadcast_buffers": False}
    # The torch installed here knows the keyword chosen for it.
    from torch.nn.parallel import DistributedDataParallel

    (key,) = distributed.no_forward_buffer_sync(DistributedDataParallel)
    assert key in inspect.signature(DistributedDataParallel.__init__).parameters
