"""The Keras side of test_keras_distributed.py, run as a subprocess with KERAS_BACKEND=jax and
XLA_FLAGS=--xla_force_host_platform_device_count=2 (both must be set before keras and jax load).

argv: JOB.json IN.npz OUT.npz. The job names the config and the cases; IN holds the weights and
the global batches; OUT gets every case's losses and final weights ("{case}/losses",
"{case}/{name}"), the sharded forward's outputs, the local shard shapes of the model=2 layout,
and the errors the mesh checks raised (in the job's "report" JSON, stored under "report").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np

from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.mesh import MeshShape, parse_mesh
from transformer_rosetta.tf_impl import distributed

job = json.loads(Path(sys.argv[1]).read_text())
config = TransformerConfig.from_dict(job["config"])
with np.load(sys.argv[2]) as npz:
    weights = {k.removeprefix("w/"): npz[k] for k in npz.files if k.startswith("w/")}
    steps = job["steps"]
    batches = [(npz[f"src/{i}"], npz[f"tgt/{i}"]) for i in range(steps)]
    tgt_in = npz["tgt_in"]
out: dict[str, np.ndarray] = {}
report: dict = {"devices": keras.distribution.list_devices(), "errors": {}}

for case in job["train"]:  # {"name", "mesh", "dtype", "denominator"}
    cast = {k: v.astype(case["dtype"]) for k, v in weights.items()}
    losses, final = distributed.train_with_denominator(
        config,
        cast,
        batches,
        parse_mesh(case["mesh"]),
        denominator=case["denominator"],
        dtype=case["dtype"],
        warmup=job["warmup"],
    )
    out[f"{case['name']}/losses"] = np.array(losses)
    for name, array in final.items():
        out[f"{case['name']}/{name}"] = array

for dtype in job["forward"]:
    mesh = MeshShape(data=1, model=2)
    cast = {k: v.astype(dtype) for k, v in weights.items()}
    result = distributed.forward_on_mesh(config, cast, batches[0][0], tgt_in, mesh, dtype=dtype)
    for name, array in result.named().items():
        out[f"forward/{dtype}/{name}"] = array

# Each device's own piece of the model=2 layout: the shape of its shard of each variable.
model, _ = distributed.build_on_mesh(config, weights, MeshShape(data=1, model=2))
report["shards"] = {
    v.path: sorted({tuple(s.data.shape) for s in v.value.addressable_shards}) for v in model.weights
}
report["shard_devices"] = {
    v.path: len({s.device for s in v.value.addressable_shards}) for v in model.weights
}

for label, mesh_text, changes in job["errors"]:
    try:
        distributed.train_on_mesh(
            config.replace(**changes), weights, batches[:1], parse_mesh(mesh_text), warmup=4
        )
        report["errors"][label] = None
    except InputError as error:
        report["errors"][label] = str(error)

out["report"] = np.array(json.dumps(report))
np.savez(sys.argv[3], **out)
