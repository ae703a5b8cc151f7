"""The promise on the writing side (docs/RELIABILITY.md): nothing is overwritten without --force,
nothing that is read is ever overwritten, no device node or FIFO is replaced, destinations are
checked before the work, a signal during a write leaves no partial file, and every refusal is one
line with exit 2. Also the parser's limits, the exit codes, and non-finite weights.

Each test asserts the exit code, that stderr is one line without a traceback, and the files on
disk before and after.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.paths import ROOT, VECTORS
from transformer_rosetta.app.tasks import get_task
from transformer_rosetta.cli import main
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights.format import load_weights, nonfinite_counts, save_weights
from transformer_rosetta.weights.init import init_weights

VECTOR = VECTORS / "pre_ln_untied.safetensors"


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, err: str, *needles: str) -> str:
    """Exit 2, one stderr line 'rosetta: error: ...' holding every needle, no traceback."""
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("rosetta: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def cli(
    *argv: object, timeout: float = 120, env_extra: dict | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process (for streams, signals and FIFOs)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "transformer_rosetta", *map(str, argv)],
        capture_output="stdout" not in kwargs and "stderr" not in kwargs,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


@pytest.fixture
def ids(tmp_path) -> tuple[Path, Path]:
    """src/tgt .npy files that fit the vector's config (vocab 37/41 both > 20)."""
    src, tgt = tmp_path / "src.npy", tmp_path / "tgt.npy"
    np.save(src, np.array([[5, 6, 7, 0], [8, 9, 0, 0]]))
    np.save(tgt, np.array([[1, 5, 6], [1, 7, 0]]))
    return src, tgt


def char_device(path: Path) -> Path:
    """A character device node (the null device's numbers) at `path`, or skip where the user may
    not make one."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


# -- 1. data loss -----------------------------------------------------------------------------


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_forward_never_overwrites_its_own_weights(capsys, tmp_path, ids, force):
    weights = tmp_path / "w.npz"  # the weights under a name that passes the suffix check
    weights.write_bytes(VECTOR.read_bytes())
    before = weights.read_bytes()
    code, _, err = run(
        capsys, "forward", "--framework", "numpy", "--weights", weights,
        "--src", ids[0], "--tgt", ids[1], "--out", weights, *force,
    )  # fmt: skip
    refused(code, err, "w.npz")
    assert weights.read_bytes() == before


def test_forward_refuses_out_of_the_wrong_kind(capsys, tmp_path, ids):
    code, _, err = run(
        capsys, "forward", "--framework", "numpy", "--weights", VECTOR,
        "--src", ids[0], "--tgt", ids[1], "--out", VECTOR.name,
    )  # fmt: skip
    refused(code, err, "should end in .npz")


def test_forward_needs_force_to_replace_an_existing_npz(capsys, tmp_path, ids):
    out = tmp_path / "out.npz"
    out.write_bytes(b"precious")
    argv = ["forward", "--framework", "numpy", "--dtype", "float64", "--weights", VECTOR,
            "--src", ids[0], "--tgt", ids[1], "--out", out]  # fmt: skip
    code, _, err = run(capsys, *argv)
    refused(code, err, "exists; pass --force")
    assert out.read_bytes() == b"precious"
    code, _, err = run(capsys, *argv, "--force")
    assert code == 0, err
    with np.load(out) as npz:
        assert npz["logits"].shape == (2, 3, load_weights(VECTOR).config.tgt_vocab_size)


def test_train_refuses_an_existing_out_before_training(capsys, tmp_path, monkeypatch):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"precious")
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", _no_training)
    code, stdout, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers", "--out", out
    )
    refused(code, err, "exists; pass --force")
    assert stdout == "" and out.read_bytes() == b"precious"


def _no_training(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("training started before the checks")


@pytest.mark.parametrize("kind", ["char-device", "fifo", "folder"])
def test_non_regular_destinations_are_never_replaced(capsys, tmp_path, ids, kind):
    out = tmp_path / "out.npz"
    if kind == "char-device":
        char_device(out)
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    mode = out.lstat().st_mode
    code, _, err = run(
        capsys, "forward", "--framework", "numpy", "--weights", VECTOR,
        "--src", ids[0], "--tgt", ids[1], "--out", out, "--force",
    )  # fmt: skip
    refused(code, err, "out.npz")
    assert out.lstat().st_mode == mode  # still the node it was


def test_convert_force_does_not_replace_a_device_node(capsys, tmp_path):
    dst = char_device(tmp_path / "dst.safetensors")
    code, _, err = run(capsys, "convert", VECTOR, dst, "--force")
    refused(code, err, "not a regular file")
    assert stat.S_ISCHR(dst.lstat().st_mode)


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> Path:
    """A base-size weight file (63M parameters, 252 MB in float32): a write long enough to be
    interrupted in the middle."""
    folder = tmp_path_factory.mktemp("base")
    config = preset("base")
    path = folder / "base.safetensors"
    save_weights(path, init_weights(config, seed=0, dtype="float32"), config, producer="test")
    (folder / "base.json").write_text(config.to_json())
    return path


@pytest.mark.parametrize(
    ("sig", "suffix", "needs"),
    [
        (signal.SIGTERM, ".pt", "torch"),
        (signal.SIGHUP, ".weights.h5", "tf"),
        (signal.SIGINT, ".msgpack", "jax"),
        (signal.SIGTERM, ".safetensors", None),
    ],
)
def test_a_signal_during_a_real_write_leaves_nothing_and_keeps_the_old_file(
    base_file, tmp_path, sig, suffix, needs
):
    if needs:
        backend_or_skip(needs)
    dst = tmp_path / f"dst{suffix}"
    dst.write_bytes(b"the previous file, byte for byte")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "transformer_rosetta", "convert", str(base_file), str(dst), "--force",
            "--config", str(base_file.with_name("base.json"))]  # fmt: skip
    if suffix == ".safetensors":
        argv = argv[:-2]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 120
    while not _writing(tmp_path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the write never started"
        time.sleep(0.002)
    proc.send_signal(sig)  # bytes are landing in the temp folder: the write is under way
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]  # no partial file or folder
    assert dst.read_bytes() == b"the previous file, byte for byte"


def _writing(folder: Path) -> bool:
    """A temp folder holds a non-empty file: the real write has begun (the up-front check makes
    a temp folder too, with an empty file, and removes it: a folder may vanish while we look)."""
    for d in folder.glob(".*.partial"):
        try:
            if any(f.stat().st_size > 0 for f in d.iterdir()):
                return True
        except OSError:
            continue
    return False


def test_the_written_file_has_ordinary_permissions(capsys, tmp_path):
    out = tmp_path / "copy.safetensors"
    code, _, err = run(capsys, "convert", VECTOR, out)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


# -- 2. outputs that cannot be written: refused before the work -------------------------------


@pytest.mark.parametrize(
    ("out", "needle"),
    [
        ("/proc/rosetta-test.npz", "in /proc"),
        ("{tmp}/no/such/folder/out.npz", "does not exist"),
        ("{tmp}", "should end in .npz"),
        ("{tmp}/folder.npz", "is a folder"),
        ("", "the file name is empty"),
        ("{tmp}/file.npz/out.npz", "file.npz"),
    ],
)
def test_forward_outputs_that_cannot_be_written(capsys, tmp_path, ids, monkeypatch, out, needle):
    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "file.npz").write_bytes(b"x")
    monkeypatch.setattr("transformer_rosetta.app.cli.forward.get_backend", _no_backend)
    code, _, err = run(
        capsys, "forward", "--framework", "numpy", "--weights", VECTOR,
        "--src", ids[0], "--tgt", ids[1], "--out", out.format(tmp=tmp_path),
    )  # fmt: skip
    refused(code, err, needle)


def _no_backend(name: str) -> None:
    raise AssertionError(f"backend {name} was loaded before the output was checked")


def test_a_read_only_folder_is_refused_before_the_work(capsys, tmp_path, ids, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        probe = folder / "probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            pytest.skip("this user writes in a read-only folder (root); /proc covers the case")
        except PermissionError:
            pass
        monkeypatch.setattr("transformer_rosetta.app.cli.forward.get_backend", _no_backend)
        code, _, err = run(
            capsys, "forward", "--framework", "numpy", "--weights", VECTOR,
            "--src", ids[0], "--tgt", ids[1], "--out", folder / "out.npz",
        )  # fmt: skip
        refused(code, err, "cannot write")
    finally:
        folder.chmod(0o755)


def test_train_checks_the_loss_plot_before_training(capsys, tmp_path, monkeypatch):
    (tmp_path / "m.loss.png").mkdir()
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", _no_training)
    code, _, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers",
        "--out", tmp_path / "m.safetensors", "--plot",
    )  # fmt: skip
    refused(code, err, "--plot", "m.loss.png", "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.loss.png"]


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_read_only_current_folder_is_refused_before_training(capsys, monkeypatch, command):
    monkeypatch.chdir("/proc")
    monkeypatch.setattr(f"transformer_rosetta.app.cli.{command}.run_training", _no_training)
    argv = ["train", "--framework", "torch", "--task", "numbers", "--out", "m.safetensors"]
    code, _, err = run(capsys, *(argv if command == "train" else ["demo"]))
    refused(code, err, "cannot write")


def test_demo_refuses_to_overwrite_an_earlier_demo_without_force(capsys, tmp_path, monkeypatch):
    folder = tmp_path / "demo"
    folder.mkdir()
    (folder / "loss.png").write_bytes(b"earlier")
    monkeypatch.setattr("transformer_rosetta.app.cli.demo.run_training", _no_training)
    code, _, err = run(capsys, "demo", "--out", folder)
    refused(code, err, "loss.png exists; pass --force")
    assert (folder / "loss.png").read_bytes() == b"earlier"


def test_demo_leaves_no_folder_when_it_fails_before_writing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("transformer_rosetta.app.cli.demo.run_training", _no_training)
    with pytest.raises(AssertionError, match="training started"):
        main(["demo", "--out", str(tmp_path / "new" / "demo")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("plot", ["file", "file-inside"])
def test_parity_plot_at_a_regular_file_is_refused_before_the_frameworks_run(
    capsys, tmp_path, monkeypatch, plot
):
    target = tmp_path / "plots"
    target.write_bytes(b"x")
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    where = target if plot == "file" else target / "inside"
    code, _, err = run(capsys, "parity", "--frameworks", "torch", "--plot", where)
    refused(code, err, "--plot")
    assert target.read_bytes() == b"x"


def _no_parity(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the frameworks ran before the checks")


def test_parity_plot_needs_force_to_replace_earlier_heatmaps(capsys, tmp_path, monkeypatch):
    (tmp_path / "encoder_layers_1_self_attention_head0.png").write_bytes(b"earlier")
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    code, _, err = run(capsys, "parity", "--frameworks", "torch", "--plot", tmp_path)
    refused(code, err, "exists; pass --force")


# -- 3. the parser's values, and estimates of memory before allocation ------------------------


def test_train_without_steps_uses_the_tasks_default(capsys, tmp_path, monkeypatch):
    seen = {}

    def record(model, task, steps, seed, label):  # noqa: ANN001, ANN202
        seen["steps"] = steps
        raise KeyboardInterrupt  # stop here: the default is what is being checked

    backend_or_skip("torch")
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", record)
    code = main(["train", "--framework", "torch", "--task", "numbers", "--out",
                 str(tmp_path / "m.safetensors")])  # fmt: skip
    assert code == 130 and seen == {"steps": 3000}  # the default the README documents
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", ["-1", "4294967296", "1e3"])
def test_seeds_outside_every_frameworks_range_are_refused(capsys, seed):
    code, _, err = run(capsys, "parity", "--frameworks", "torch", "--seed", seed)
    refused(code, err, "--seed")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["parity", "--batch", "1000000", "--src-len", "1000000"], "this parity run needs about"),
        (["bench", "--batch", "100000", "--src-len", "100000"], "this benchmark needs about"),
    ],
)
def test_requests_too_big_for_this_machine_are_refused_up_front(capsys, monkeypatch, argv, needle):
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    code, _, err = run(capsys, *argv)
    refused(code, err, needle, "GiB")


def test_a_vocabulary_of_1e15_is_refused_before_allocating(capsys, tmp_path):
    config = preset("tiny").to_dict() | {"src_vocab_size": 10**15, "tgt_vocab_size": 10**15}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(config))
    code, _, err = run(capsys, "parity", "--config", path, "--frameworks", "torch")
    refused(code, err, "needs about", "GiB")


def test_stdout_on_a_full_device_is_one_line_and_exit_2(tmp_path):
    with open("/dev/full", "w") as full:
        proc = cli("inspect", "--preset", "tiny", stdout=full, stderr=subprocess.PIPE)
    err = proc.stderr
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "No space left on device" in err and "Traceback" not in err


# -- 4. exit codes and early validation -------------------------------------------------------


def test_bench_with_only_the_oracle_is_bad_input(capsys):
    refused(*run(capsys, "bench", "--frameworks", "numpy")[::2], "the oracle has no peer")


def test_forward_with_stderr_closed_still_works(tmp_path, ids):
    backend_or_skip("torch")
    out = tmp_path / "out.npz"
    proc = subprocess.run(
        f"{sys.executable} -m transformer_rosetta forward --framework torch --weights {VECTOR} "
        f"--src {ids[0]} --tgt {ids[1]} --out {out} 2>&-",
        shell=True,
        capture_output=False,
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0 and "wrote" in proc.stdout
    with np.load(out) as npz:
        assert np.isfinite(npz["logits"]).all()


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--plot-layer", "5", "--plot-layer 5 is outside the model's layers 0..1"),
        ("--plot-head", "9", "--plot-head 9 is outside the model's heads 0..1"),
        ("--plot-row", "4", "--plot-row 4 is outside the batch rows 0..3"),
    ],
)
def test_plot_choices_are_checked_before_any_framework_runs(
    capsys, tmp_path, monkeypatch, option, value, needle
):
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    code, _, err = run(capsys, "parity", "--plot", tmp_path / "p", option, value)
    refused(code, err, needle)
    assert not (tmp_path / "p").exists()


def test_a_bare_rosetta_is_one_line_on_stderr_and_exit_2(capsys):
    code, out, err = run(capsys)
    refused(code, err, "no command given", "rosetta --help")
    assert out == ""


def test_a_file_name_with_a_newline_makes_a_one_line_error(capsys, tmp_path):
    code, _, err = run(capsys, "convert", tmp_path / "a\nb.safetensors", tmp_path / "c.pt")
    refused(code, err, "a\\nb.safetensors")
    out = tmp_path / "x\ny.npz"
    out.write_bytes(b"kept")
    code, _, err = run(capsys, "forward", "--framework", "numpy", "--weights", VECTOR,
                       "--src", "s.npy", "--tgt", "t.npy", "--out", out)  # fmt: skip
    refused(code, err, "x\\ny.npz exists")


def test_parity_on_a_gpu_that_is_not_there_is_bad_input(capsys):
    backend = backend_or_skip("torch")
    if any(d != "cpu" for d in backend.devices()):
        pytest.skip("a GPU is visible to torch here")
    code, _, err = run(capsys, "parity", "--frameworks", "torch", "--device", "gpu")
    refused(code, err, "--device gpu: no GPU is visible to torch")


# -- 6. non-finite weights --------------------------------------------------------------------


@pytest.fixture
def nan_file(tmp_path) -> Path:
    """The numbers task's model with 3 NaN and 1 Inf in two tensors."""
    task = get_task("numbers")
    config = task.config()
    weights = init_weights(config, seed=0, dtype="float32")
    first, second = list(weights)[1:3]
    weights[first].flat[:3] = np.nan
    weights[second].flat[0] = -np.inf
    path = tmp_path / "nan.safetensors"
    save_weights(path, weights, config, producer="test", task=task.name)
    assert nonfinite_counts(load_weights(path).tensors) == {
        first: {"nan": 3, "inf": 0},
        second: {"nan": 0, "inf": 1},
    }
    return path


def test_inspect_reports_nonfinite_tensors_and_counts(capsys, nan_file):
    wf = load_weights(nan_file)
    first, second = list(wf.tensors)[1:3]
    code, out, err = run(capsys, "inspect", nan_file)
    assert code == 0
    assert f"WARNING: 2 tensors hold non-finite values ({first}: 3 NaN; {second}: 1 Inf)" in out
    assert err.count("\n") == 1 and "non-finite" in err
    code, out, _ = run(capsys, "inspect", nan_file, "--json")
    assert json.loads(out)["nonfinite"] == {
        first: {"nan": 3, "inf": 0},
        second: {"nan": 0, "inf": 1},
    }


@pytest.mark.parametrize("command", ["translate", "convert", "train"])
def test_nonfinite_weights_are_refused_unless_allowed(capsys, tmp_path, nan_file, command):
    backend_or_skip("torch")
    argv = {
        "translate": ["translate", "--framework", "torch", "--weights", nan_file, "12"],
        "convert": ["convert", nan_file, tmp_path / "out.pt"],
        "train": ["train", "--framework", "torch", "--task", "numbers", "--weights", nan_file,
                  "--steps", "1", "--out", tmp_path / "out.safetensors"],
    }[command]  # fmt: skip
    code, out, err = run(capsys, *argv)
    refused(code, err, "2 tensors hold non-finite values", "--allow-nonfinite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.safetensors"]
    code, out, err = run(capsys, *argv, "--allow-nonfinite")
    assert code == 0, err


def test_forward_warns_on_nonfinite_weights(tmp_path, nan_file):
    src, tgt = tmp_path / "s.npy", tmp_path / "t.npy"
    np.save(src, np.array([[4, 5, 6]]))
    np.save(tgt, np.array([[1, 4]]))
    proc = cli(
        "forward", "--framework", "numpy", "--dtype", "float64", "--weights", nan_file,
        "--src", src, "--tgt", tgt, "--out", tmp_path / "o.npz",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # one line: numpy's own RuntimeWarnings about the NaN arithmetic are not repeated
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("rosetta: warning: ")
    assert "2 tensors hold non-finite values" in proc.stderr
    with np.load(tmp_path / "o.npz") as npz:
        assert np.isnan(npz["logits"]).all()


# -- a second round: cases a fresh hostile run found ------------------------------------------


def test_translate_refuses_a_beam_wider_than_the_vocabulary(capsys, nan_file):
    code, _, err = run(
        capsys, "translate", "--framework", "torch", "--weights", nan_file,
        "--allow-nonfinite", "--beam", "100000000", "12",
    )  # fmt: skip
    refused(code, err, "--beam 100000000 is wider than the target vocabulary")


@pytest.mark.parametrize("beam", ["1", "3"])
def test_allowed_nonfinite_weights_decode_to_nothing_without_crashing(capsys, nan_file, beam):
    code, out, err = run(
        capsys, "translate", "--framework", "torch", "--weights", nan_file,
        "--allow-nonfinite", "--beam", beam, "--json", "12", "5",
    )  # fmt: skip
    assert code == 0, err
    assert [row["output"] for row in json.loads(out)] == ["", ""]


def test_parity_plot_with_an_empty_folder_name_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    refused(*run(capsys, "parity", "--frameworks", "torch", "--plot", "")[::2], "empty")


def test_bench_repeats_are_bounded(capsys):
    refused(*run(capsys, "bench", "--repeats", "100000000000")[::2], "at most 1000")


@pytest.mark.parametrize("option", ["--weights", "--inputs"])
def test_an_input_inside_the_plot_folder_is_never_overwritten(capsys, tmp_path, option):
    folder = tmp_path / "plots"
    folder.mkdir()
    victim = folder / "encoder_layers_1_self_attention_head0.png"
    if option == "--weights":
        config = preset("tiny")
        save_weights(victim, init_weights(config, seed=0), config, producer="test")
    else:
        np.savez(victim.with_suffix(".npz"), src=np.ones((2, 3), int), tgt=np.ones((2, 2), int))
        victim.with_suffix(".npz").rename(victim)
    before = victim.read_bytes()
    code, _, err = run(
        capsys, "parity", "--frameworks", "torch", option, victim, "--plot", folder, "--force"
    )
    refused(code, err, "is also an input")
    assert victim.read_bytes() == before


def test_train_never_writes_its_loss_plot_over_its_starting_weights(capsys, tmp_path, monkeypatch):
    task = get_task("numbers")
    weights = tmp_path / "m.loss.png"
    save_weights(weights, init_weights(task.config(), seed=0), task.config(), "t", task="numbers")
    before = weights.read_bytes()
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", _no_training)
    code, _, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers", "--weights", weights,
        "--out", tmp_path / "m.safetensors", "--plot", "--force",
    )  # fmt: skip
    refused(code, err, "m.loss.png is also an input")
    assert weights.read_bytes() == before


def test_convert_never_writes_into_the_folder_it_reads(capsys, tmp_path):
    folder = tmp_path / "marian"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"the model")
    code, _, err = run(
        capsys, "convert", folder, folder / "pytorch_model.bin", "--to", "torch", "--force"
    )
    refused(code, err, "inside the input folder")
    assert (folder / "pytorch_model.bin").read_bytes() == b"the model"


def test_a_file_name_too_long_for_the_file_system_is_refused_before_training(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", _no_training)
    out = tmp_path / ("x" * 300 + ".safetensors")
    code, _, err = run(capsys, "train", "--framework", "torch", "--task", "numbers", "--out", out)
    refused(code, err, "File name too long")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB file system (tmpfs), or skip where this user may not mount one."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".weights.h5", ".msgpack"])
def test_a_disk_too_small_is_refused_before_writing(capsys, base_file, small_disk, suffix):
    code, _, err = run(
        capsys, "convert", base_file, small_disk / f"base{suffix}",
        "--config", base_file.with_name("base.json"),
    )  # fmt: skip
    refused(code, err, "MiB free")
    assert list(small_disk.iterdir()) == []


def test_train_refuses_a_disk_too_small_before_training(capsys, small_disk, monkeypatch):
    (small_disk / "filler").write_bytes(b"\0" * 150_000)
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", _no_training)
    code, _, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers",
        "--out", small_disk / "m.safetensors",
    )  # fmt: skip
    refused(code, err, "MiB free")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


@pytest.mark.parametrize("command", ["parity", "demo"])
def test_plots_and_demos_refuse_a_disk_too_small_before_running(
    capsys, small_disk, monkeypatch, command
):
    monkeypatch.setattr("transformer_rosetta.app.parity.run_parity", _no_parity)
    monkeypatch.setattr("transformer_rosetta.app.cli.demo.run_training", _no_training)
    argv = {
        "parity": ["parity", "--frameworks", "torch", "--plot", small_disk / "plots"],
        "demo": ["demo", "--out", small_disk / "demo"],
    }[command]
    code, _, err = run(capsys, *argv)
    refused(code, err, "MiB free")
    assert list(small_disk.iterdir()) == []


def test_a_name_the_terminal_cannot_encode_is_escaped(tmp_path):
    out = tmp_path / "modèle.safetensors"
    env = {"PYTHONIOENCODING": "ascii"}
    proc = cli("convert", VECTOR, out, env_extra=env)
    assert proc.returncode == 0, proc.stderr
    assert "mod\\xe8le.safetensors" in proc.stdout and out.exists()


def test_a_destination_that_appears_during_the_work_is_not_replaced(capsys, tmp_path, monkeypatch):
    out = tmp_path / "m.safetensors"

    def someone_else_writes(*_args: object, **_kwargs: object) -> list[float]:
        out.write_bytes(b"theirs")  # another program, while this one trains
        return [1.0]

    backend_or_skip("torch")
    monkeypatch.setattr("transformer_rosetta.app.cli.train.run_training", someone_else_writes)
    monkeypatch.setattr("transformer_rosetta.app.cli.train.exact_match", lambda *a: (0.0, []))
    code, _, err = run(capsys, "train", "--framework", "torch", "--task", "numbers", "--out", out)
    assert code == 2 and "appeared while this command worked" in err.splitlines()[-1]
    assert out.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_fifo_or_external_storage_is_never_read_as_a_keras_file(capsys, tmp_path, config_json):
    h5py = pytest.importorskip("h5py")
    fifo = tmp_path / "fifo.weights.h5"
    os.mkfifo(fifo)
    proc = cli("convert", fifo, tmp_path / "o.safetensors", "--config", config_json, timeout=60)
    assert proc.returncode == 2 and "FIFO" in proc.stderr, proc.stderr
    external = tmp_path / "ext.weights.h5"
    with h5py.File(external, "w") as h5:
        h5.create_dataset("x", shape=(4,), dtype="f4", external=[("/dev/zero", 0, 16)])
    code, _, err = run(capsys, "convert", external, tmp_path / "o.safetensors", "--config",
                       config_json)  # fmt: skip
    assert code == 2 and "o.safetensors" not in os.listdir(tmp_path)


@pytest.fixture
def config_json(tmp_path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(preset("tiny").to_json())
    return path


def test_convert_never_writes_over_its_config(capsys, tmp_path, config_json):
    before = config_json.read_bytes()
    code, _, err = run(capsys, "convert", VECTOR, config_json, "--to", "rosetta", "--config",
                       config_json, "--force")  # fmt: skip
    refused(code, err, "is also an input")
    assert config_json.read_bytes() == before


def test_ids_with_a_negative_size_in_their_header_are_refused(capsys, tmp_path):
    src = tmp_path / "s.npy"
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (-2, -3), }"
    src.write_bytes(b"\x93NUMPY\x01\x00" + len(header.ljust(117) + "\n").to_bytes(2, "little")
                    + (header.ljust(117) + "\n").encode() + b"\0" * 48)  # fmt: skip
    code, _, err = run(capsys, "forward", "--framework", "numpy", "--dtype", "float64",
                       "--weights", VECTOR, "--src", src, "--tgt", src,
                       "--out", tmp_path / "o.npz")  # fmt: skip
    refused(code, err, "sizes must be whole numbers")


def test_inspect_of_an_empty_file_name_is_refused(capsys):
    refused(*run(capsys, "inspect", "")[::2], "the file name is empty")


def test_an_error_on_a_full_stderr_still_exits_2(tmp_path):
    with open("/dev/full", "w") as full:
        proc = cli("inspect", tmp_path / "nope.safetensors", stdout=subprocess.PIPE, stderr=full)
    assert proc.returncode == 2


def test_a_reader_that_goes_away_does_not_stop_the_work(tmp_path):
    backend_or_skip("torch")
    out = tmp_path / "m.safetensors"
    proc = subprocess.run(
        f"{sys.executable} -m transformer_rosetta train --framework torch --task numbers --steps 2 "
        f"--out {out} | head -c1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert "Traceback" not in proc.stderr
    assert load_weights(out).metadata["task"] == "numbers"  # trained and written all the same


def test_an_error_quoting_a_huge_input_stays_a_readable_line(capsys, tmp_path):
    task = get_task("numbers")
    path = tmp_path / "m.safetensors"
    save_weights(path, init_weights(task.config(), seed=0), task.config(), "t", task="numbers")
    code, _, err = run(
        capsys, "translate", "--framework", "torch", "--weights", path, "9" * 100_000
    )
    refused(code, err, "characters in all")
    assert len(err) < 1100


@pytest.mark.parametrize("argv", [["VECTOR", ""], ["", "o.pt"]])
def test_convert_names_an_empty_file_name(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    argv = [str(VECTOR) if a == "VECTOR" else a for a in argv]
    refused(*run(capsys, "convert", *argv)[::2], "the file name is empty")
    assert list(tmp_path.iterdir()) == []


def test_a_repeated_json_key_is_refused_in_headers_and_configs(capsys, tmp_path):
    raw = VECTOR.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].decode().rstrip()
    first = header.index('"__metadata__"')
    # The same metadata twice: json.loads would keep the second without a word.
    doubled = header[:-1] + "," + header[first:-1] + "}"
    doubled = doubled.encode().ljust((len(doubled) + 7) // 8 * 8)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(len(doubled).to_bytes(8, "little") + doubled + raw[8 + n :])
    refused(*run(capsys, "inspect", path)[::2], "'__metadata__' appears more than once")
    config = tmp_path / "dup.json"
    config.write_text('{"d_model": 16, "num_heads": 2, "d_model": 64}')
    refused(*run(capsys, "inspect", "--config", config)[::2], "'d_model' appears more than once")
