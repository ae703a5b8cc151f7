"""Importing an implementation changes no framework's matmul precision.

The precision switches are process-wide (torch's fp32_precision, JAX's default matmul precision,
TensorFlow's TF32 flag). Each implementation sets them only inside its precision.py's
`matmul_precision` block, which every call of a backend model runs in; an import that set them
would change what other code in the process computes. The switches are set to TF32 first (the
value a pin to full precision would overwrite), then every module of the three implementations is
imported in the same fresh process, under Keras's default backend, and the switches must read as
before. (impl/test_keras_backends.py checks the same import under Keras's JAX and PyTorch backends.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from parity_tests.paths import ROOT

IMPLS = ("torch_impl", "tf_impl", "jax_impl")
MODULES = ("precision", "model", "decode", "train", "weights", "backend")

SCRIPT = r"""
import importlib
import json
import sys

import jax
import tensorflow as tf
import torch


def switches():
    return {
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "torch.backends.cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "torch.backends.cudnn.fp32_precision": torch.backends.cudnn.fp32_precision,
        "tensor_float_32_execution_enabled": tf.config.experimental.tensor_float_32_execution_enabled(),
    }


jax.config.update("jax_default_matmul_precision", "tensorfloat32")
torch.backends.cuda.matmul.fp32_precision = "tf32"
torch.backends.cudnn.fp32_precision = "tf32"
tf.config.experimental.enable_tensor_float_32_execution(True)
before = switches()
changed = {}
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    now = switches()
    if now != before:
        changed[name] = now
        break
print(json.dumps({"before": before, "changed": changed}))
"""


def test_importing_the_implementations_leaves_the_precision_switches_alone():
    missing = [
        pkg
        for pkg in ("torch", "tensorflow", "keras", "jax", "flax")
        if not importlib.util.find_spec(pkg)
    ]
    if missing:
        pytest.skip(f"needs every framework: {', '.join(missing)} not installed")
    names = [f"transformer_rosetta.{impl}.{module}" for impl in IMPLS for module in MODULES]
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(names)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["before"]["jax_default_matmul_precision"] == "tensorfloat32", report
    assert report["before"]["tensor_float_32_execution_enabled"] is True, report
    assert report["changed"] == {}, f"an import changed a precision switch: {report}"
