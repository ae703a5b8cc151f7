"""tf_impl/model.py on Keras's JAX and PyTorch backends, against the float64 oracle, on the
backend's own default device (the GPU when one is visible).

Keras fixes its backend when it is first imported, so each backend runs in a subprocess with
KERAS_BACKEND set. The subprocess builds the model through tf_impl/weights.py (new_model,
load_canonical) in float32 with the weights of a stored test vector (VECTORS: the paper's model in
miniature: post-norm, relu, interleaved sinusoids, one shared and tied embedding; the Keras test in
impl/test_tf_impl.py covers the other switches, pre-norm, tanh GELU, learned positions, untied output,
no biases, on the CPU), and compares every output (logits, encoder output, hidden states, and on
the explicit attention path every attention map; the fused path as well) with the oracle run in
float64 on the same float32-rounded weights. The bound is the project's float32 bound,
`atol_for("float32", config)` from common/spec/tolerances.py (1e-5 at this tiny size). One config
only: under JAX every new shape compiles its ops, which is most of the subprocess's time.

In the same subprocess it checks the precision switch (tf_impl/precision.py): the backend's
switch is first set to TF32; importing transformer_rosetta.tf_impl.model must leave it so (no
import-time side effect), and the model then runs inside `matmul_precision("highest")`, which
must read full precision (`jax_default_matmul_precision` "highest"; torch's `fp32_precision`
"ieee" for both cuBLAS and cuDNN) and put TF32 back on exit. Without that block a user calling
the layers directly gets TF32 products on an Ampere or later GPU (1.7e-3 from the oracle,
measured on an H100 under KERAS_BACKEND=jax; 7.7e-7 inside it).

Each test prints the device its backend ran on (run pytest with -s to see it) and asserts that it
is a GPU whenever that backend sees one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from parity_tests.paths import ROOT
from parity_tests.vectors.make_vectors import VECTOR_CONFIGS
from transformer_rosetta.spec.tolerances import atol_for

VECTORS = ["post_ln_shared"]

# Run with KERAS_BACKEND set; argv[1] is a JSON list of vector names. Prints one JSON line.
SCRIPT = r"""
import json
import sys

import keras

backend = keras.backend.backend()
# Turn TF32 on first: the import below must leave it on, and only matmul_precision turn it off.
if backend == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "tensorfloat32")
elif backend == "torch":
    import torch

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.fp32_precision = "tf32"


def switches():
    if backend == "jax":
        return {"jax_default_matmul_precision": jax.config.jax_default_matmul_precision}
    return {
        "torch.backends.cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "torch.backends.cudnn.fp32_precision": torch.backends.cudnn.fp32_precision,
    }


import transformer_rosetta.tf_impl.model  # noqa: F401  (must change no switch)

after_import = switches()
if backend == "jax":
    gpus = [str(d) for d in jax.devices() if d.platform != "cpu"]
else:
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]

import numpy as np

from transformer_rosetta.oracle import reference
from transformer_rosetta.weights.format import load_weights
from parity_tests.vectors.make_vectors import HERE
from transformer_rosetta.tf_impl.precision import matmul_precision
from transformer_rosetta.tf_impl.weights import load_canonical, new_model


def device_of(x):
    if backend == "jax":
        return ",".join(sorted(str(d) for d in x.devices()))
    return str(x.device)


results = []
devices = set()
pinned = {}
for name in json.loads(sys.argv[1]):
    stored = load_weights(HERE / f"{name}.safetensors")
    config = stored.config
    rounded = {k: v.astype(np.float32).astype(np.float64) for k, v in stored.tensors.items()}
    with np.load(HERE / f"{name}.npz", allow_pickle=False) as npz:
        src, tgt_in = npz["src"], npz["tgt_in"]
    want = reference.forward(rounded, config, src, tgt_in, hidden_states=True)
    model = new_model(config, "float32")
    load_canonical(model, stored.tensors)
    for attention in (True, False):
        with matmul_precision("highest"):  # full float32 products, as a backend model runs
            pinned = switches()
            got = model(src, tgt_in, training=False, return_attention=attention)
        devices.add(device_of(got["logits"]))
        keys = ["encoder_hidden_states", "decoder_hidden_states"]
        if attention:
            keys += ["encoder_self_attention", "decoder_self_attention", "cross_attention"]
        pairs = [("logits", got["logits"], want.logits)]
        pairs.append(("encoder_output", got["encoder_output"], want.encoder_output))
        for key in keys:
            assert len(got[key]) == len(getattr(want, key)), key
            pairs += [(f"{key}.{i}", g, w) for i, (g, w) in enumerate(zip(got[key], getattr(want, key)))]
        worst, where, dtypes = 0.0, "", set()
        for label, g, w in pairs:
            g = keras.ops.convert_to_numpy(g)
            dtypes.add(str(g.dtype))
            assert g.shape == w.shape, (label, g.shape, w.shape)
            assert np.all(np.isfinite(g)), f"{label}: non-finite values"
            diff = float(np.max(np.abs(g.astype(np.float64) - w)))
            if diff >= worst:
                worst, where = diff, label
        results.append(
            {"vector": name, "attention": attention, "max_abs": worst, "where": where,
             "compared": len(pairs), "dtypes": sorted(dtypes)}
        )
print(json.dumps({"backend": backend, "after_import": after_import, "pinned": pinned,
                  "restored": switches(), "gpus": gpus, "devices": sorted(devices),
                  "results": results}))
"""

EXPECTED_PINS = {
    "jax": {"jax_default_matmul_precision": "highest"},
    "torch": {
        "torch.backends.cuda.matmul.fp32_precision": "ieee",
        "torch.backends.cudnn.fp32_precision": "ieee",
    },
}
# What the script sets before importing the model: TF32, which the import must leave alone.
TF32 = {
    "jax": {"jax_default_matmul_precision": "tensorfloat32"},
    "torch": {
        "torch.backends.cuda.matmul.fp32_precision": "tf32",
        "torch.backends.cudnn.fp32_precision": "tf32",
    },
}


def missing_reason(backend: str) -> str | None:
    """Why Keras cannot run on `backend` here, or None."""
    missing = [pkg for pkg in ("keras", backend) if importlib.util.find_spec(pkg) is None]
    if missing:
        return f"KERAS_BACKEND={backend}: {' and '.join(missing)} not installed"
    return None


def run_keras_on(backend: str) -> dict:
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(VECTORS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"Keras on {backend} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_model_matches_the_oracle_on_its_default_device(backend):
    reason = missing_reason(backend)
    if reason:
        pytest.skip(reason)
    report = run_keras_on(backend)
    assert report["backend"] == backend
    assert report["after_import"] == TF32[backend], (
        f"importing transformer_rosetta.tf_impl.model changed the matmul precision under "
        f"{backend}: {report['after_import']}"
    )
    assert report["pinned"] == EXPECTED_PINS[backend], (
        f"matmul_precision('highest') did not pin full float32 products under {backend}: "
        f"{report['pinned']}"
    )
    assert report["restored"] == TF32[backend], report["restored"]
    # Outputs live on the backend's default device: a GPU whenever the backend sees one.
    devices = report["devices"]
    print(f"\nKeras on {backend}: ran on {', '.join(devices)} (GPUs visible: {report['gpus']})")
    if report["gpus"]:
        assert all("cpu" not in d.lower() for d in devices), (
            f"{backend} sees {report['gpus']} but the model ran on {devices}"
        )
    assert len(report["results"]) == 2 * len(VECTORS)
    for result in report["results"]:
        assert result["dtypes"] == ["float32"], result
        bound = atol_for("float32", VECTOR_CONFIGS[result["vector"]])
        assert result["max_abs"] <= bound, (
            f"Keras on {backend} ({', '.join(devices)}), vector {result['vector']}, "
            f"attention={result['attention']}: {result['where']} off by "
            f"{result['max_abs']:.3g} > {bound:g}"
        )
        print(
            f"  {result['vector']}, attention={result['attention']}: largest |diff| "
            f"{result['max_abs']:.2e} ({result['where']}, {result['compared']} arrays) <= {bound:g}"
        )
