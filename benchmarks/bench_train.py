"""Training throughput: target tokens per second of full optimizer steps (forward, backward, Adam).

    .venv/bin/python -m transformer_rosetta.benchmarks.bench_train [--workload numbers|base] [--frameworks torch tf jax]
        [--device D] [--precision highest|tf32|bf16] [--steps N] [--repeats N] [--json]
        [--preset tiny|base|big] [--vocab N] [--batch N] [--src-len N] [--tgt-len N]

Two workloads, each timed side by side in one run (warm-up rounds first, so that tracing and
compilation are left out; then rounds in alternation; medians):

- numbers (the default on a CPU, unless a base-only option is given): our model in each framework on the "numbers" task
  (common/app/tasks.py: batch 64, sources of 6 characters, targets of 12 words, d_model 64),
  through the adapter exactly as `rosetta train` drives it: one `train_steps([(src, tgt)])` call
  per step, on the task's own batches. The frameworks alternate with each other, and each is
  reported as its ratio to torch's tokens/s: the target is tf and jax >= 0.8x torch.
- base (the default on a GPU): the base model (32000-token vocabulary, no dropout), batch 64,
  source and target 128 tokens with no padding (8192 target tokens per step), ours (the
  adapter's `train_steps`, one call per round of steps) against a peer training loop written
  with the framework's own layers and optimizer: torch.nn.Transformer + torch.optim.Adam; the
  Keras peer + keras.optimizers.Adam in an XLA-compiled tf.function; the Flax peer +
  optax.adam in an nnx.jit step. Each framework runs after the previous one is done, ours and
  its peer alternating. The target is >= 300,000 target tokens/s in bf16 on one H100. On a CPU,
  `--preset tiny` keeps it to seconds.

Every contender runs on the same device at the same precision (harness.PRECISION_HELP), inside
its framework's matmul_precision. Adam's betas and epsilon are the paper's (0.9, 0.98, 1e-9) for
ours and the peers; the peers train at a constant rate (ours follows the Noam schedule: a few
scalar operations a step). A target token is a target position that is not padding: the tokens
the loss counts. TFLOP/s counts a step as three forward passes' matmul FLOPs.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.cli.args import UsageError, positive_int, repeats_int, seed_int
from transformer_rosetta.app.tasks import get_task
from transformer_rosetta.benchmarks.harness import (
    add_device_arguments,
    alternate,
    base_benchmark_config,
    cli_main,
    device_name,
    dump,
    framework_precision,
    parser,
    plan_devices,
    precision_setting,
    to_stderr,
    train_step_flops,
    workload_sizes,
)
from transformer_rosetta.benchmarks.suite import under
from transformer_rosetta.oracle.training import ADAM_BETAS, ADAM_EPS
from transformer_rosetta.spec.config import PRESETS, TransformerConfig, preset
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.precision import bench_setting
from transformer_rosetta.weights.init import init_weights

FRAMEWORKS = ("torch", "tf", "jax")
WORKLOADS = ("numbers", "base")
NUMBERS_TARGET = 0.8  # tf and jax reach at least 0.8x torch's tokens/s on the numbers task
BASE_TARGET = 300_000  # target tokens/s, bf16, one H100
BASE_DEFAULTS = dict(preset="base", vocab=32000, batch=64, src_len=128, tgt_len=128)
PEER_LR = 1e-4  # the peers' constant rate: throughput does not depend on it
WARMUP_STEPS = 3  # at least this many steps before timing: the first ones trace and compile

Batch = tuple[np.ndarray, np.ndarray]  # (src (B, S), tgt (B, T)) ids
Progress = Callable[[str], None]


def warmup_rounds(steps: int) -> int:
    """Rounds of `steps` steps that make at least WARMUP_STEPS steps."""
    return -(-WARMUP_STEPS // steps)


def target_tokens(batches: Sequence[Batch], pad_id: int) -> int:
    """The target positions that are not padding: what the loss counts, and tokens/s counts."""
    return int(sum((tgt != pad_id).sum() for _, tgt in batches))


def random_batches(
    c: TransformerConfig, batch: int, src_len: int, tgt_len: int, steps: int, seed: int
) -> list[Batch]:
    """`steps` batches of random ordinary ids (no pad, BOS or EOS): every position counts."""
    rng = np.random.default_rng(seed)
    special = [c.pad_id, c.bos_id, c.eos_id]

    def ids(vocab: int, length: int) -> np.ndarray:
        return rng.choice(np.setdiff1d(np.arange(vocab), special), size=(batch, length))

    return [(ids(c.src_vocab_size, src_len), ids(c.tgt_vocab_size, tgt_len)) for _ in range(steps)]


# -- the peers' training loops, each in its framework's own idiom ------------------------------
# Each returns run(batches) -> losses: one optimizer step per (src, tgt) batch, the numpy ids
# moved to the device at every step (as ours does), blocking until the last step is done.


def torch_peer(c: TransformerConfig, dtype: str, device: str) -> Callable[[list[Batch]], list]:
    """torch.nn.Transformer (benchmarks/bench_torch_impl_forward.Peer) + torch.optim.Adam, eager,
    F.cross_entropy with label smoothing; the losses are read once, after the last step."""
    import torch
    import torch.nn.functional as F

    from transformer_rosetta.benchmarks.bench_torch_impl_forward import Peer
    from transformer_rosetta.torch_impl.weights import TORCH_DTYPES

    torch.manual_seed(0)
    peer = Peer(c, c.max_len).to(device=device, dtype=TORCH_DTYPES[dtype]).train()
    optimizer = torch.optim.Adam(peer.parameters(), lr=PEER_LR, betas=ADAM_BETAS, eps=ADAM_EPS)

    def run(batches: list[Batch]) -> list[float]:
        losses = []
        for src, tgt in batches:
            src_t, tgt_in_t, tgt_t = (
                torch.from_numpy(a).to(device) for a in (src, shift_right(tgt, c.bos_id), tgt)
            )
            optimizer.zero_grad(set_to_none=True)
            logits = peer(src_t, tgt_in_t)
            loss = F.cross_entropy(
                logits.flatten(0, 1),
                tgt_t.flatten(),
                ignore_index=c.pad_id,
                label_smoothing=c.label_smoothing,
            )
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses).float().tolist()  # waits for the device

    return run


def keras_peer(c: TransformerConfig, dtype: str, device: str) -> Callable[[list[Batch]], list]:
    """The Keras peer (benchmarks/bench_tf_impl_forward.PeerTransformer) + keras.optimizers.Adam,
    one XLA-compiled tf.function step with tf.GradientTape, Keras's label-smoothed
    categorical_crossentropy."""
    import keras
    import tensorflow as tf
    from keras import ops

    from transformer_rosetta.benchmarks.bench_tf_impl_forward import PeerTransformer
    from transformer_rosetta.tf_impl.backend import tf_device

    where = tf_device(device)
    with tf.device(where):
        keras.utils.set_random_seed(0)
        peer = PeerTransformer(c, dtype=dtype)
        src0, tgt0 = random_batches(c, 1, 2, 2, 1, 0)[0]
        peer(tf.constant(src0), tf.constant(shift_right(tgt0, c.bos_id)))  # builds the variables
        optimizer = keras.optimizers.Adam(
            PEER_LR, beta_1=ADAM_BETAS[0], beta_2=ADAM_BETAS[1], epsilon=ADAM_EPS
        )
        optimizer.build(peer.trainable_variables)  # variables may not be made inside the trace

    @tf.function(jit_compile=True)
    def step(src: tf.Tensor, tgt_in: tf.Tensor, tgt: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = peer(src, tgt_in, training=True)
            per_token = keras.losses.categorical_crossentropy(
                ops.one_hot(tgt, c.tgt_vocab_size, dtype=logits.dtype),
                logits,
                from_logits=True,
                label_smoothing=c.label_smoothing,
            )
            keep = ops.cast(ops.not_equal(tgt, c.pad_id), "float32")
            loss = ops.sum(ops.cast(per_token, "float32") * keep) / ops.maximum(ops.sum(keep), 1)
        grads = tape.gradient(loss, peer.trainable_variables)
        optimizer.apply_gradients(zip(grads, peer.trainable_variables, strict=True))
        return loss

    def run(batches: list[Batch]) -> list[float]:
        with tf.device(where):
            losses = [step(src, shift_right(tgt, c.bos_id), tgt) for src, tgt in batches]
            return [float(loss.numpy()) for loss in losses]

    return run


def flax_peer(c: TransformerConfig, dtype: str, device: str) -> Callable[[list[Batch]], list]:
    """The Flax peer (benchmarks/bench_jax_impl_forward.Peer) + optax.adam in nnx.Optimizer, one
    nnx.jit step with nnx.value_and_grad, optax's softmax_cross_entropy on smoothed labels; the
    steps queue on the device and the losses are read once, after the last."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from transformer_rosetta.benchmarks.bench_jax_impl_forward import Peer
    from transformer_rosetta.jax_impl.backend import jax_device

    target = jax_device(device)
    with jax.default_device(target):
        peer = Peer(c, nnx.Rngs(0), jnp.dtype(dtype))
        tx = optax.adam(PEER_LR, b1=ADAM_BETAS[0], b2=ADAM_BETAS[1], eps=ADAM_EPS)
        optimizer = nnx.Optimizer(peer, tx, wrt=nnx.Param)

    @nnx.jit
    def step(
        model: Peer, optimizer: nnx.Optimizer, src: jax.Array, tgt_in: jax.Array, tgt: jax.Array
    ) -> jax.Array:
        def loss_fn(model: Peer) -> jax.Array:
            logits = model(src, tgt_in)
            labels = jax.nn.one_hot(tgt, c.tgt_vocab_size, dtype=logits.dtype)
            per_token = optax.softmax_cross_entropy(
                logits, optax.smooth_labels(labels, c.label_smoothing)
            )
            keep = tgt != c.pad_id
            return jnp.sum(per_token.astype(jnp.float32) * keep) / jnp.maximum(keep.sum(), 1)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def run(batches: list[Batch]) -> list[float]:
        losses = []
        for src, tgt in batches:
            # int32 ids: JAX's default integer without x64, as ours takes them
            ids = tuple(a.astype(np.int32) for a in (src, shift_right(tgt, c.bos_id), tgt))
            losses.append(step(peer, optimizer, *jax.device_put(ids, target)))
        return [float(loss) for loss in losses]  # one wait, after the last step

    return run


PEERS = {"torch": torch_peer, "tf": keras_peer, "jax": flax_peer}
PEER_NAMES = {
    "torch": "torch.nn.Transformer + torch.optim.Adam (eager)",
    "tf": "Keras layers + keras.optimizers.Adam (tf.function, XLA)",
    "jax": "Flax nnx layers + optax.adam (nnx.jit)",
}


# -- the two workloads ------------------------------------------------------------------------


def _framework_info(name: str, device: str) -> dict[str, str]:
    return {
        "framework": name,
        "version": get_backend(name).version(),
        "device": device,
        "device_name": device_name(name, device),
    }


def _release(device: str) -> None:
    """Free what a finished framework held on the device before the next one starts."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def measure_numbers(
    devices: Mapping[str, str],
    precision: str,
    steps: int,
    repeats: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Our model in every framework of `devices` ({framework: device}) on the numbers task, the
    frameworks alternating round by round; each one's tokens/s and ratio to torch's."""
    dtype, mode = bench_setting(precision)
    task = get_task("numbers")
    config = task.config()
    weights = init_weights(config, seed=seed, scheme="paper")
    stream = task.train_batches(seed)
    batches = [stream.next_batch() for _ in range(steps)]
    tokens = target_tokens(batches, config.pad_id)
    models = {
        name: get_backend(name).build(config, weights, dtype=dtype, device=device, precision=mode)
        for name, device in devices.items()
    }
    last: dict[str, float] = {}

    def one_round(name: str) -> Callable[[], None]:
        model = models[name]

        def run() -> None:
            for batch in batches:  # as `rosetta train` does: one call per step
                (last[name],) = model.train_steps(
                    [batch], warmup=task.warmup, factor=task.lr_factor
                )

        return under(lambda: framework_precision(name, mode), run)

    times = alternate(
        "train", {name: one_round(name) for name in models}, repeats, warmup_rounds(steps), progress
    )
    results: dict[str, dict[str, Any]] = {}
    for name, seconds in times.items():
        per_s = tokens / seconds
        results[name] = {
            **_framework_info(name, devices[name]),
            "median_s": seconds,
            "tokens_per_s": per_s,
            "last_loss": last[name],
        }
    if "torch" in results:
        for name, r in results.items():
            r["ratio_to_torch"] = r["tokens_per_s"] / results["torch"]["tokens_per_s"]
            if name != "torch":
                r["target_met"] = r["ratio_to_torch"] >= NUMBERS_TARGET
    return {
        "workload": {
            "name": "numbers",
            "task": task.name,
            "batch": task.batch_size,
            "src_len": task.source_width,
            "tgt_len": task.target_width,
            "d_model": config.d_model,
            "layers": [config.num_encoder_layers, config.num_decoder_layers],
            "steps_per_round": steps,
            "target_tokens_per_round": tokens,
            "repeats": repeats,
            **precision_setting(precision),
        },
        "results": results,
        "target": {"ratio_to_torch": NUMBERS_TARGET},
    }


def base_config(preset_name: str, vocab: int, src_len: int, tgt_len: int) -> TransformerConfig:
    """The model of the base workload: a preset with `vocab` tokens on both sides (shared and
    tied, as in the paper), no dropout, and room for the lengths asked for."""
    c = base_benchmark_config() if preset_name == "base" else preset(preset_name)
    return c.replace(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        dropout=0.0,
        attention_dropout=0.0,
        max_len=max(c.max_len, src_len, tgt_len),
    )


def _ours_and_peer(
    name: str,
    device: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: list[Batch],
    dtype: str,
    mode: str,
    steps: int,
    repeats: int,
    progress: Progress | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of a round of ours and of the peer in one framework, alternating, and the
    last loss of each; both are released when this returns."""
    model = get_backend(name).build(config, weights, dtype=dtype, device=device, precision=mode)
    peer = PEERS[name](config, dtype, device)
    last: dict[str, float] = {}

    def ours_round() -> None:
        last["ours"] = model.train_steps(batches, warmup=4000, factor=1.0)[-1]

    def peer_round() -> None:
        last["peer"] = peer(batches)[-1]

    with framework_precision(name, mode):
        times = alternate(
            name, {"ours": ours_round, "peer": peer_round}, repeats, warmup_rounds(steps), progress
        )
    return times, last


def measure_base(
    devices: Mapping[str, str],
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    precision: str,
    steps: int,
    repeats: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Ours against the framework's own training loop, per framework of `devices`, one
    framework after another; tokens/s, TFLOP/s and the ratio ours / peer."""
    dtype, mode = bench_setting(precision)
    say = progress or (lambda message: None)
    batches = random_batches(config, batch, src_len, tgt_len, steps, seed)
    tokens = target_tokens(batches, config.pad_id)
    step_flops = train_step_flops(config, batch, src_len, tgt_len)
    weights = init_weights(config, seed=seed, scheme="paper")
    results: dict[str, dict[str, Any]] = {}
    for name, device in devices.items():
        say(f"{name}: building ours and the peer on {device}")
        times, last = _ours_and_peer(
            name, device, config, weights, batches, dtype, mode, steps, repeats, progress
        )
        per_s = {who: tokens / s for who, s in times.items()}
        results[name] = {
            **_framework_info(name, device),
            "peer": PEER_NAMES[name],
            "median_s": times,
            "tokens_per_s": per_s,
            "tflops": {who: steps * step_flops / s / 1e12 for who, s in times.items()},
            "ratio_to_peer": per_s["ours"] / per_s["peer"],
            "target_met": per_s["ours"] >= BASE_TARGET,
            "last_loss": last,
        }
        _release(device)
    if "torch" in results:
        for r in results.values():
            r["ratio_to_torch"] = (
                r["tokens_per_s"]["ours"] / results["torch"]["tokens_per_s"]["ours"]
            )
    return {
        "workload": {
            "name": "base",
            **workload_sizes(config, batch, src_len, tgt_len),
            "padding": "none",
            "steps_per_round": steps,
            "target_tokens_per_round": tokens,
            "train_step_tflop": step_flops / 1e12,
            "repeats": repeats,
            **precision_setting(precision),
        },
        "results": results,
        "target": {"tokens_per_s": BASE_TARGET, "applies_to": "bf16 on one H100"},
    }


# -- report and command line ------------------------------------------------------------------


def format_train(result: Mapping[str, Any]) -> str:
    """The human-readable report of measure_numbers or measure_base (plus "skipped")."""
    w = result["workload"]
    setting = f"{w['dtype']} (precision {w['precision']})"
    lines = []
    if w["name"] == "numbers":
        lines.append(
            f"workload numbers: the task's model (d_model {w['d_model']}, layers "
            f"{w['layers'][0]}+{w['layers'][1]}), batch {w['batch']}, src/tgt "
            f"{w['src_len']}/{w['tgt_len']}, {w['steps_per_round']} steps a round "
            f"({w['target_tokens_per_round']:,} target tokens), {setting}; median of "
            f"{w['repeats']} rounds"
        )
        for name, r in result["results"].items():
            ratio = ""
            if "ratio_to_torch" in r:
                ratio = f"  {r['ratio_to_torch']:.2f}x torch"
                if "target_met" in r:
                    verdict = "met" if r["target_met"] else "NOT met"
                    ratio += f" (target >= {NUMBERS_TARGET:.1f}: {verdict})"
            lines.append(
                f"{name:<6} {r['version']:<34} {r['device']} ({r['device_name']})  "
                f"{r['tokens_per_s']:>12,.0f} target tok/s{ratio}  loss {r['last_loss']:.3f}"
            )
    else:
        lines.append(
            f"workload base: d_model {w['d_model']}, h {w['heads']}, d_ff {w['d_ff']}, layers "
            f"{w['layers'][0]}+{w['layers'][1]}, vocab {w['tgt_vocab']}; batch {w['batch']}, "
            f"src/tgt {w['src_len']}/{w['tgt_len']} without padding, {w['steps_per_round']} steps "
            f"a round ({w['target_tokens_per_round']:,} target tokens), {setting}; median of "
            f"{w['repeats']} rounds"
        )
        for name, r in result["results"].items():
            lines.append("")
            lines.append(f"{name}: {r['version']} on {r['device']} ({r['device_name']})")
            for who, label in (("ours", "ours (adapter train_steps)"), ("peer", r["peer"])):
                lines.append(
                    f"  {label:<58s} {r['tokens_per_s'][who]:>12,.0f} target tok/s "
                    f"{r['tflops'][who]:8.3f} TFLOP/s  loss {r['last_loss'][who]:.3f}"
                )
            verdict = "met" if r["target_met"] else "NOT met"
            torch_ratio = f"; {r['ratio_to_torch']:.2f}x torch's" if "ratio_to_torch" in r else ""
            lines.append(
                f"  ours/peer {r['ratio_to_peer']:.2f}x{torch_ratio}; target >= "
                f"{BASE_TARGET:,} tok/s in bf16 on one H100: {verdict}"
            )
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"{name}: skipped ({reason})")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    """Parse, check every argument and the devices, then measure and print."""
    p = parser("python -m transformer_rosetta.benchmarks.bench_train", __doc__)
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="default: base on a GPU or when a base-only option is given, else numbers",
    )
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    add_device_arguments(p)
    p.add_argument("--steps", type=positive_int, default=10, help="steps a timed round (10)")
    p.add_argument("--repeats", type=repeats_int, default=5, help="timed rounds (5), median taken")
    p.add_argument("--seed", type=seed_int, default=0, help="weights and batches (0)")
    base = p.add_argument_group("the base workload only")
    base.add_argument("--preset", choices=list(PRESETS), help="default: base (tiny for a CPU test)")
    base.add_argument("--vocab", type=positive_int, help="both vocabularies (default 32000)")
    base.add_argument("--batch", type=positive_int, help="default 64")
    base.add_argument("--src-len", type=positive_int, help="default 128")
    base.add_argument("--tgt-len", type=positive_int, help="default 128")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(None if argv is None else list(argv))
    sizes = {k: getattr(args, k) for k in BASE_DEFAULTS}
    given = ["--" + k.replace("_", "-") for k, v in sizes.items() if v is not None]
    if args.workload == "numbers" and given:
        raise UsageError(f"{', '.join(given)}: only for --workload base; the task fixes its model")
    devices, skipped = plan_devices(args.frameworks, args.device)
    if not devices:
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
        raise UsageError(f"no framework can run here ({reasons})")
    on_gpu = any(device != "cpu" for device in devices.values())
    workload = args.workload or ("base" if given or on_gpu else "numbers")
    progress = None if args.json else to_stderr
    if workload == "numbers":
        result = measure_numbers(
            devices, args.precision, args.steps, args.repeats, args.seed, progress
        )
    else:
        s = {k: BASE_DEFAULTS[k] if v is None else v for k, v in sizes.items()}
        config = base_config(s["preset"], s["vocab"], s["src_len"], s["tgt_len"])
        result = measure_base(
            devices,
            config,
            s["batch"],
            s["src_len"],
            s["tgt_len"],
            args.precision,
            args.steps,
            args.repeats,
            args.seed,
            progress,
        )
    result["skipped"] = skipped
    print(dump(result) if args.json else format_train(result), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main("python -m transformer_rosetta.benchmarks.bench_train", lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
