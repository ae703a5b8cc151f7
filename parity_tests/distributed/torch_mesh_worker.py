"""The multi-process side of test_torch_distributed.py: runs the torch mesh cases in processes of
its own and writes what they return to one .npz, so that the test process never starts a process
group. Two entry points:

    python -m parity_tests.distributed.torch_mesh_worker local IN.npz OUT.npz
        (from the checkout's root) every case through launch_local: one job of 2 ranks runs the
        training and forward cases (each rank's results kept, to compare the ranks), then a job
        whose rank 1 raises at step 3, then train_on_mesh and forward_on_mesh as a caller uses
        them; the sharded run's weights are saved as the shared format.
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
            parity_tests/distributed/torch_mesh_worker.py torchrun IN.npz OUT.npz
        train_on_mesh and forward_on_mesh in each process torchrun starts; rank 0 writes.
    python -m parity_tests.distributed.torch_mesh_worker hsdp IN.npz OUT.npz
        training on a data=2 x model=2 mesh (HSDP), 4 ranks.

IN.npz holds the config (as JSON), the canonical weights (w:NAME), the global batches (src:I,
tgt:I), the forward's inputs (fwd_src, fwd_tgt_in), warmup, and two checkpoint paths: the sharded
run's, and the one the failing run must not write.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file by torchrun: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.mesh import MeshShape  # noqa: E402
from transformer_rosetta.spec.results import ForwardOutput  # noqa: E402
from transformer_rosetta.torch_impl import distributed  # noqa: E402
from transformer_rosetta.weights.format import save_weights  # noqa: E402

DATA, MODEL = MeshShape(data=2), MeshShape(model=2)
FAIL_RANK, FAIL_STEP = 1, 3


def read_inputs(path: str) -> dict:
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    config = TransformerConfig.from_json(str(arrays["config"]))
    n = int(arrays["steps"])
    return {
        "config": config,
        "weights": {k[2:]: v for k, v in arrays.items() if k.startswith("w:")},
        "batches": [
            (arrays[f"src:{i}"] if f"src:{i}" in arrays else None, arrays[f"tgt:{i}"])
            for i in range(n)
        ],
        "fwd": (arrays.get("fwd_src"), arrays["fwd_tgt_in"]),
        "warmup": int(arrays["warmup"]),
        "checkpoint": str(arrays["checkpoint"]),
        "failed_checkpoint": str(arrays["failed_checkpoint"]),
    }


def flat_forward(prefix: str, out: ForwardOutput) -> dict[str, np.ndarray]:
    return {f"{prefix}:{name}": a for name, a in out.named().items()}


def flat_train(prefix: str, losses: list[float], weights: dict) -> dict[str, np.ndarray]:
    found = {f"{prefix}:losses": np.array(losses)}
    found.update({f"{prefix}:w:{name}": a for name, a in weights.items()})
    return found


def rank_cases(inputs: dict) -> dict[str, np.ndarray]:
    """Every training and forward case in one job of 2 ranks (one process group, so one start):
    what this rank ends with, under `case:` keys."""
    c, w, batches, warmup = inputs["config"], inputs["weights"], inputs["batches"], inputs["warmup"]
    out: dict[str, np.ndarray] = {}
    for case, mesh, dtype, local_mean in (
        ("data64", DATA, "float64", False),
        ("naive64", DATA, "float64", True),
        ("data32", DATA, "float32", False),
        ("model64", MODEL, "float64", False),
        ("model32", MODEL, "float32", False),
    ):
        r = distributed.train_rank(
            c, w, batches, mesh, dtype=dtype, warmup=warmup, local_mean=local_mean
        )
        out.update(flat_train(case, r.losses, r.weights))
        if case == "model64":
            out.update({f"shard:{k}": np.array(s) for k, s in r.shards.items()})
    for case, mesh, dtype in (
        ("fwd_model64", MODEL, "float64"),
        ("fwd_model32", MODEL, "float32"),
        ("fwd_data64", DATA, "float64"),
    ):
        out.update(flat_forward(case, distributed.forward_rank(c, w, *inputs["fwd"], mesh, dtype)))
    return out


def fail_at_step(step: int) -> None:
    """The fault: rank FAIL_RANK raises before its step FAIL_STEP."""
    if int(os.environ["RANK"]) == FAIL_RANK and step == FAIL_STEP:
        raise ValueError(f"injected fault at step {step}")


def failing_rank(inputs: dict) -> distributed.RankResult:
    return distributed.train_rank(
        inputs["config"],
        inputs["weights"],
        inputs["batches"],
        DATA,
        dtype="float64",
        warmup=inputs["warmup"],
        on_step=fail_at_step,
    )


def run_local(inputs: dict) -> dict[str, np.ndarray]:
    c, w = inputs["config"], inputs["weights"]
    results = {}
    start = time.perf_counter()
    ranks = distributed.launch_local(rank_cases, 2, inputs)
    results["time:cases"] = np.array(time.perf_counter() - start)
    for rank, found in ranks.items():
        results.update({f"rank{rank}:{k}": v for k, v in found.items()})

    # A rank that raises: the launcher's error, how long it took, and no checkpoint after it.
    start = time.perf_counter()
    try:
        ranks = distributed.launch_local(failing_rank, 2, inputs)
        # What a caller does once the run is over: never reached when a rank fails.
        save_weights(inputs["failed_checkpoint"], ranks[0].weights, c, "torch mesh")
        results["failure"] = np.array("")
    except distributed.RankFailed as exc:
        results["failure"] = np.array(str(exc))
    results["time:failure"] = np.array(time.perf_counter() - start)

    # The public functions, as a caller uses them; the sharded run saved as the shared format.
    start = time.perf_counter()
    losses, weights = distributed.train_on_mesh(
        c, w, inputs["batches"], MODEL, dtype="float64", warmup=inputs["warmup"]
    )
    save_weights(inputs["checkpoint"], weights, c, "torch mesh model=2")
    results.update(flat_train("public_model64", losses, weights))
    fwd = distributed.forward_on_mesh(c, w, *inputs["fwd"], DATA, dtype="float64")
    results.update(flat_forward("public_fwd_data64", fwd))
    results["time:public"] = np.array(time.perf_counter() - start)
    return results


def run_torchrun(inputs: dict) -> dict[str, np.ndarray] | None:
    c, w = inputs["config"], inputs["weights"]
    losses, weights = distributed.train_on_mesh(
        c, w, inputs["batches"], DATA, dtype="float64", warmup=inputs["warmup"]
    )
    fwd = distributed.forward_on_mesh(c, w, *inputs["fwd"], MODEL, dtype="float64")
    if int(os.environ["RANK"]) != 0:
        return None
    return {**flat_train("torchrun_data64", losses, weights), **flat_forward("torchrun_fwd", fwd)}


def hsdp_rank(inputs: dict) -> distributed.RankResult:
    return distributed.train_rank(
        inputs["config"],
        inputs["weights"],
        inputs["batches"],
        MeshShape(data=2, model=2),
        dtype="float64",
        warmup=inputs["warmup"],
    )


def run_hsdp(inputs: dict) -> dict[str, np.ndarray]:
    """data=2 x model=2 in 4 ranks (launch_local, past the device check: 4 ranks on fewer cores
    only share them)."""
    result = distributed.launch_local(hsdp_rank, 4, inputs)[0]
    return flat_train("hsdp64", result.losses, result.weights)


def main(argv: list[str]) -> None:
    mode, source, target = argv
    inputs = read_inputs(source)
    runs = {"local": run_local, "torchrun": run_torchrun, "hsdp": run_hsdp}
    results = runs[mode](inputs)
    if results is not None:
        np.savez(target, **results)
        print(json.dumps({k: float(v) for k, v in results.items() if k.startswith("time:")}))


if __name__ == "__main__":
    main(sys.argv[1:])
