"""--device on a machine with several GPUs, faked: the device each framework is asked to run on,
for every form of request, in that framework's own naming.

No GPU is needed. Each framework's own device enumeration (torch.cuda.device_count,
tf.config.list_logical_devices, jax.devices, onnxruntime.get_available_providers) is replaced by
one that reports three GPUs, or none; then the resolver (transformer_rosetta.app.cli.args.device_for and
check_devices_visible, over transformer_rosetta.app.parity.resolve_devices and each backend's devices()) and
each framework's own translation of the name it returns (torch.device, tf_impl's tf_device,
jax_impl's jax_device, the onnxruntime session's provider options) are read back.

The expected devices are written out here from the documented rule (README, docs/DESIGN.md
"Devices"): `gpu:N` and `cuda:N` name the N-th GPU in every framework, `gpu`, `cuda` and `auto`
the first, `auto` the cpu when there is no GPU, and a device the framework does not see is refused
before any work, in one line naming the request. With one GPU, or none, "the first GPU" and "the
N-th" cannot be told apart, which is why three are faked: a resolver that always took the first
would pass every test with fewer. impl/test_devices.py runs the models on the real devices there are.
"""

from __future__ import annotations

import pytest

from parity_tests.conftest import backend_or_skip
from transformer_rosetta.adapter.backends import RUNTIMES, get_backend, unavailable_reason
from transformer_rosetta.app.cli.args import (
    UsageError,
    check_devices_visible,
    device_arg,
    device_for,
)
from transformer_rosetta.app.parity import resolve_devices

GPUS = 3  # one more than "the first" and "the second": gpu:2 is the third, gpu:3 is past the end

# Each framework's devices as its backend lists them with three GPUs, and the place each one
# means in the framework's own terms, written out: torch.device, TensorFlow's device string,
# (platform, id) of the jax.Device.
LISTED = {
    "torch": ["cpu", "cuda:0", "cuda:1", "cuda:2"],
    "tf": ["cpu", "gpu:0", "gpu:1", "gpu:2"],
    "jax": ["cpu", "gpu:0", "gpu:1", "gpu:2"],
}
OWN_NAME = {
    "torch": {"cpu": "cpu", 0: "cuda:0", 1: "cuda:1", 2: "cuda:2"},
    "tf": {"cpu": "/CPU:0", 0: "/GPU:0", 1: "/GPU:1", 2: "/GPU:2"},
    "jax": {"cpu": ("cpu", 0), 0: ("gpu", 0), 1: ("gpu", 1), 2: ("gpu", 2)},
}
# request -> the GPU it names (its index) or "cpu"
NAMED = {
    "auto": 0,
    "gpu": 0,
    "cuda": 0,
    "gpu:0": 0,
    "cuda:0": 0,
    "gpu:1": 1,
    "cuda:1": 1,
    "gpu:2": 2,
    "cuda:2": 2,
    "cpu": "cpu",
}
PAST_THE_END = ("gpu:3", "cuda:3", "gpu:10")


class FakeJaxDevice:
    """What jax_device hands to jax.device_put: here, only its platform and id are read."""

    def __init__(self, platform: str, index: int) -> None:
        self.platform, self.id = platform, index

    def __repr__(self) -> str:
        return f"FakeJaxDevice({self.platform}:{self.id})"


def fake_gpus(monkeypatch, framework: str, count: int, mps: bool = False) -> None:
    """Make `framework` enumerate `count` GPUs, as it would on such a machine (torch: and the
    Apple MPS device when `mps`). The backend itself is left as it is."""
    backend_or_skip(framework)
    if framework == "torch":
        import torch

        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    elif framework == "tf":
        import tensorflow as tf

        real = tf.config.list_logical_devices
        gpus = [
            tf.config.LogicalDevice(name=f"/device:GPU:{i}", device_type="GPU")
            for i in range(count)
        ]

        def list_logical_devices(device_type: str | None = None) -> list:
            if device_type == "GPU":
                return gpus
            return real(device_type) + (gpus if device_type is None else [])

        monkeypatch.setattr(tf.config, "list_logical_devices", list_logical_devices)
    elif framework == "jax":
        import jax

        real = jax.devices
        gpus = [FakeJaxDevice("gpu", i) for i in range(count)]

        def devices(backend: str | None = None) -> list:
            if backend in ("gpu", "cuda"):
                if not gpus:  # what JAX raises on a machine without one
                    raise RuntimeError(f"Unknown backend {backend}")
                return gpus
            return real(backend)

        monkeypatch.setattr(jax, "devices", devices)
    elif framework == "onnx":
        import onnxruntime as ort

        providers = [*(["CUDAExecutionProvider"] if count else []), "CPUExecutionProvider"]
        monkeypatch.setattr(ort, "get_available_providers", lambda: providers)
    else:
        raise AssertionError(framework)


def own_name(framework: str, device: str) -> object:
    """Where `framework` puts work for `device` (a name its backend lists), in its own terms."""
    if framework == "torch":
        import torch

        return str(torch.device(device))
    if framework == "tf":
        from transformer_rosetta.tf_impl.backend import tf_device

        return tf_device(device)
    if framework == "jax":
        from transformer_rosetta.jax_impl.backend import jax_device

        placed = jax_device(device)
        return (placed.platform, placed.id)
    raise AssertionError(framework)


def sessions_made(monkeypatch) -> list[list]:
    """Replace onnxruntime.InferenceSession by a recorder of the providers each session asks for."""
    import onnxruntime as ort

    made: list[list] = []

    def inference_session(model: object, options: object, providers: list) -> object:
        made.append(providers)
        return object()

    monkeypatch.setattr(ort, "InferenceSession", inference_session)
    return made


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# -- every framework with three GPUs ----------------------------------------------------------


@pytest.mark.parametrize("framework", list(LISTED))
def test_a_backend_lists_every_gpu_it_sees_by_its_index(monkeypatch, framework):
    """The names resolution chooses among: one per GPU, each with its own index (a list of three
    "cuda:0" would send every request to the first GPU)."""
    fake_gpus(monkeypatch, framework, GPUS)
    assert get_backend(framework).devices() == LISTED[framework]


@pytest.mark.parametrize("framework", list(LISTED))
@pytest.mark.parametrize(("request_", "which"), list(NAMED.items()))
def test_each_request_runs_on_the_device_it_names(monkeypatch, framework, request_, which):
    """`--device gpu:2` and `--device cuda:2` are the third GPU in every framework (torch cuda:2,
    TensorFlow /GPU:2, JAX's gpu device 2), whichever framework's spelling the user chose;
    auto, gpu and cuda are the first GPU; cpu is the cpu even where GPUs are seen."""
    fake_gpus(monkeypatch, framework, GPUS)
    resolved = device_for(framework, request_)
    assert own_name(framework, resolved) == OWN_NAME[framework][which]


@pytest.mark.parametrize("framework", list(LISTED))
@pytest.mark.parametrize("request_", PAST_THE_END)
def test_a_gpu_past_the_last_is_refused_in_one_line_naming_it(monkeypatch, framework, request_):
    """Three GPUs are 0, 1 and 2: gpu:3 is refused before any work (never quietly another GPU),
    in one line naming the request, the framework and the devices it does see."""
    fake_gpus(monkeypatch, framework, GPUS)
    with pytest.raises(UsageError) as refused:
        device_for(framework, request_)
    message = one_line(refused)
    assert message.startswith(f"--device {request_}: {framework} ")
    assert message.endswith(f"(it sees {', '.join(LISTED[framework])})")


@pytest.mark.parametrize("framework", list(LISTED))
def test_without_a_gpu_auto_is_the_cpu_and_a_gpu_is_refused(monkeypatch, framework):
    """The default works on every machine: no GPU, auto is the cpu. A GPU asked for by name is
    then refused, not replaced by the cpu."""
    fake_gpus(monkeypatch, framework, 0)
    assert get_backend(framework).devices() == ["cpu"]
    assert own_name(framework, device_for(framework, "auto")) == OWN_NAME[framework]["cpu"]
    for request_ in ("gpu", "cuda", "gpu:0", "cuda:1"):
        with pytest.raises(UsageError) as refused:
            device_for(framework, request_)
        assert (
            one_line(refused)
            == f"--device {request_}: {framework} sees no such device (it sees cpu)"
        )


@pytest.mark.parametrize("framework", list(LISTED))
def test_all_is_every_device_and_only_for_parity(monkeypatch, framework):
    """`rosetta parity --device all` runs each device the framework sees, each GPU once; a
    command that runs one device refuses "all" in one line."""
    fake_gpus(monkeypatch, framework, GPUS)
    seen = get_backend(framework).devices()
    assert resolve_devices(framework, seen, "all") == LISTED[framework]
    with pytest.raises(UsageError) as refused:
        device_for(framework, "all")
    assert "--device all" in one_line(refused)


def test_jax_refuses_a_gpu_it_does_not_have_in_one_line(monkeypatch):
    """jax_device, JAX's own resolver (what build and the benchmarks call), takes the N-th GPU
    and refuses one past the end by name, listing the devices there are."""
    fake_gpus(monkeypatch, "jax", GPUS)
    import jax

    from transformer_rosetta.jax_impl.backend import jax_device

    assert jax_device("gpu:2") is jax.devices("gpu")[2]
    with pytest.raises(ValueError) as refused:
        jax_device("gpu:3")
    assert one_line(refused) == (
        "device: unknown 'gpu:3'; this machine has cpu, gpu:0, gpu:1, gpu:2"
    )


# -- Apple's MPS (torch only) -----------------------------------------------------------------


def test_mps_is_used_only_when_named(monkeypatch):
    """MPS computes no float64, so auto never picks it: auto is the cpu, `mps` is MPS, and `gpu`
    (a CUDA GPU) is refused."""
    fake_gpus(monkeypatch, "torch", 0, mps=True)
    assert get_backend("torch").devices() == ["cpu", "mps"]
    assert device_for("torch", "auto") == "cpu"
    assert device_for("torch", "mps") == "mps"
    with pytest.raises(UsageError) as refused:
        device_for("torch", "gpu")
    assert one_line(refused) == "--device gpu: torch sees no such device (it sees cpu, mps)"


@pytest.mark.parametrize("framework", ["tf", "jax"])
def test_mps_is_refused_where_the_framework_has_none(monkeypatch, framework):
    fake_gpus(monkeypatch, framework, GPUS)
    with pytest.raises(UsageError) as refused:
        device_for(framework, "mps")
    assert one_line(refused).startswith(f"--device mps: {framework} sees no such device")


# -- onnxruntime: the CUDA provider, device 0 ------------------------------------------------


@pytest.mark.parametrize("request_", ["auto", "gpu", "cuda", "gpu:0", "cuda:0"])
def test_onnx_runs_the_first_gpu_on_cuda_device_0(monkeypatch, request_):
    """onnxruntime's backend lists its CUDA provider as one GPU, cuda:0: every request for the
    first GPU gets a session on CUDA device 0, with TF32 off."""
    fake_gpus(monkeypatch, "onnx", GPUS)
    from transformer_rosetta.adapter.onnx_backend import session

    assert get_backend("onnx").devices() == ["cpu", "cuda:0"]
    made = sessions_made(monkeypatch)
    session(b"graph", device_for("onnx", request_))
    assert made == [[("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "0"})]]


def test_onnx_refuses_a_gpu_it_does_not_list(monkeypatch):
    fake_gpus(monkeypatch, "onnx", GPUS)
    with pytest.raises(UsageError) as refused:
        device_for("onnx", "gpu:1")
    assert one_line(refused) == "--device gpu:1: onnx sees no such device (it sees cpu, cuda:0)"


def test_onnx_without_cuda_runs_on_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, "onnx", 0)
    from transformer_rosetta.adapter.onnx_backend import session

    made = sessions_made(monkeypatch)
    session(b"graph", device_for("onnx", "auto"))
    assert made == [["CPUExecutionProvider"]]
    with pytest.raises(UsageError):
        device_for("onnx", "gpu")


@pytest.mark.parametrize(("device", "index"), [("cuda:0", "0"), ("cuda:1", "1"), ("cuda:2", "2")])
def test_an_onnx_session_on_cuda_n_asks_for_device_n(monkeypatch, device, index):
    """session(), onnxruntime's placement: the CUDA provider is given the index the device name
    holds (its device_id option), not always device 0."""
    backend_or_skip("onnx")
    from transformer_rosetta.adapter.onnx_backend import session

    made = sessions_made(monkeypatch)
    session(b"graph", device)
    assert made == [[("CUDAExecutionProvider", {"device_id": index, "use_tf32": "0"})]]


# -- a command's check before any work (rosetta parity, bench, demo) -------------------------


def every_runtime(monkeypatch, count: int) -> list[str]:
    """Every runtime but the oracle, each seeing `count` GPUs (onnx: its one CUDA device)."""
    runtimes = [r for r in RUNTIMES if r != "numpy"]
    missing = [r for r in runtimes if unavailable_reason(r) is not None]
    if missing:
        pytest.skip(f"needs every runtime; {', '.join(missing)} cannot run here")
    for framework in runtimes:
        fake_gpus(monkeypatch, framework, count)
    return runtimes


def test_a_command_refuses_a_gpu_no_framework_sees(monkeypatch):
    """`rosetta parity --device gpu:2` goes ahead when some framework sees a third GPU, and
    `--device gpu:3` is refused before any model is built, in one line naming the request."""
    runtimes = every_runtime(monkeypatch, GPUS)
    assert runtimes == ["torch", "tf", "jax", "onnx"]
    check_devices_visible(["numpy", *runtimes], "gpu:2")
    check_devices_visible(["numpy", *runtimes], "cuda:1")
    for request_ in PAST_THE_END:
        with pytest.raises(UsageError) as refused:
            check_devices_visible(["numpy", *runtimes], request_)
        assert one_line(refused) == (
            f"--device {request_}: no such device is visible to torch, tf, jax, onnx"
        )


def test_a_command_without_gpus_refuses_gpu_and_runs_auto(monkeypatch):
    runtimes = every_runtime(monkeypatch, 0)
    check_devices_visible(runtimes, "auto")
    with pytest.raises(UsageError) as refused:
        check_devices_visible(runtimes, "gpu")
    assert one_line(refused) == "--device gpu: no GPU is visible to torch, tf, jax, onnx"


# -- the form of a request -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["auto", "cpu", "gpu", "cuda", "mps", "gpu:0", "gpu:2", "cuda:12"])
def test_device_arg_takes_every_documented_form(text):
    assert device_arg(text) == text


@pytest.mark.parametrize("text", ["tpu", "gpu:", "gpu:-1", "cuda:x", "cuda:1:2", "GPU:1", ""])
def test_device_arg_refuses_other_forms_in_one_line(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError) as refused:
        device_arg(text)
    assert one_line(refused).startswith(f"unknown device {text!r}; give auto")
