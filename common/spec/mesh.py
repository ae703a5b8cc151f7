"""A device mesh as the command line names it, written once for the three distributed engines.

`--mesh data=2,model=2` (or `--data-parallel 2`, which is `data=2`) names a two-axis mesh:
- `data`: replicas of the model, each on its own block of the global batch's rows (data
  parallelism: torch DDP / FSDP2, a jax.sharding batch axis, keras.distribution.DataParallel);
- `model`: the parameters split across devices (FSDP2 over the mesh, jax NamedSharding of the
  attention heads and the feed-forward, keras.distribution.ModelParallel's LayoutMap).

Everything here is framework-free: parsing, the checks made before any process or device starts,
the rows each data replica takes, and the loss weight that makes N replicas compute the one-device
loss (docs/DESIGN.md, "Distribution").

The loss (section 5.4) is a mean over the global batch's non-pad target tokens. A replica that
averages over its own tokens computes a different quantity whenever replicas hold different
numbers of non-pad tokens (a ragged batch), and the engines' gradient averaging (DDP's all-reduce
mean, `pmean`) does not undo it: mean_r(S_r / T_r) != sum_r(S_r) / T. So each replica divides its
token sum by the GLOBAL token count T (every replica knows it: all read the same global batch),
and the engine's reduction is then a sum (or a mean scaled back by N).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig

MESH_AXES = ("data", "model")
_AXIS = re.compile(r"^\s*([a-z]+)\s*=\s*([0-9]{1,6})\s*$")


@dataclass(frozen=True)
class MeshShape:
    """How many devices along each axis: data replicas x model shards."""

    data: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        """The devices (torch: processes) the mesh needs: data * model."""
        return self.data * self.model

    @property
    def shape(self) -> tuple[int, int]:
        """(data, model), in MESH_AXES order: the shape jax.sharding.Mesh and keras take."""
        return (self.data, self.model)

    def __str__(self) -> str:
        return ",".join(f"{axis}={n}" for axis, n in zip(MESH_AXES, self.shape, strict=True))


def parse_mesh(text: str) -> MeshShape:
    """`data=2,model=2` -> MeshShape(2, 2); an axis left out has size 1. InputError, one line,
    for an unknown axis, a repeated one, a size that is not a positive integer."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        found = _AXIS.match(part)
        if found is None:
            raise InputError(
                f"--mesh {text!r}: each part must be AXIS=N with AXIS one of "
                f"{', '.join(MESH_AXES)}, e.g. data=2,model=2"
            )
        axis, n = found.group(1), int(found.group(2))
        if axis not in MESH_AXES:
            raise InputError(f"--mesh {text!r}: unknown axis {axis!r}; the axes are data, model")
        if axis in sizes:
            raise InputError(f"--mesh {text!r}: axis {axis!r} is given twice")
        if n < 1:
            raise InputError(f"--mesh {text!r}: {axis} must be at least 1, got {n}")
        sizes[axis] = n
    return MeshShape(**sizes)


def mesh_problems(
    mesh: MeshShape,
    config: TransformerConfig,
    *,
    batch: int | None = None,
    devices: int | None = None,
) -> list[str]:
    """Every reason `mesh` cannot run `config` (at global batch `batch` rows, on `devices`
    devices), named, before anything starts. The model axis splits the attention heads and the
    feed-forward's inner width (Megatron-style tensor parallelism), so both must divide, and so
    must the key/value heads of grouped-query attention."""
    problems = []
    if batch is not None and batch % mesh.data:
        problems.append(f"the batch of {batch} rows does not divide over data={mesh.data} replicas")
    if mesh.model > 1:
        if config.num_heads % mesh.model:
            problems.append(
                f"num_heads={config.num_heads} does not divide over model={mesh.model} shards"
            )
        if config.kv_heads != config.num_heads and config.kv_heads % mesh.model:
            problems.append(
                f"num_kv_heads={config.kv_heads} does not divide over model={mesh.model} shards"
            )
        if config.d_ff % mesh.model:
            problems.append(f"d_ff={config.d_ff} does not divide over model={mesh.model} shards")
    if devices is not None and mesh.size > devices:
        problems.append(
            f"the mesh {mesh} needs {mesh.size} devices, and {devices} "
            f"{'is' if devices == 1 else 'are'} available"
        )
    return problems


def check_mesh(
    mesh: MeshShape,
    config: TransformerConfig,
    *,
    batch: int | None = None,
    devices: int | None = None,
) -> None:
    """mesh_problems as one InputError (one line, exit 2 at the command line)."""
    problems = mesh_problems(mesh, config, batch=batch, devices=devices)
    if problems:
        raise InputError(f"--mesh {mesh}: " + "; ".join(problems))


def replica_rows(batch: int, data: int, replica: int) -> slice:
    """The contiguous block of the global batch's rows that data replica `replica` (0-based)
    takes: rows [replica * batch/data, (replica + 1) * batch/data). The same split as
    jax.sharding's over a leading `data` axis and torch's DistributedSampler without shuffling
    (contiguous rather than strided)."""
    if batch % data:
        raise InputError(f"the batch of {batch} rows does not divide over data={data} replicas")
    if not 0 <= replica < data:
        raise ValueError(f"replica {replica} is outside 0..{data - 1}")
    per = batch // data
    return slice(replica * per, (replica + 1) * per)


def target_tokens(tgt: np.ndarray, pad_id: int) -> int:
    """The non-pad target tokens of a batch: the loss's denominator (section 5.4). Computed on
    the GLOBAL batch, it is what each replica divides its own token sum by."""
    return int((np.asarray(tgt) != pad_id).sum())


def replica_loss_scale(global_tokens: int, replicas: int, *, engine_averages: bool) -> float:
    """The factor a replica multiplies its SUM of per-token losses by, so that the engine's
    gradient reduction yields the gradient of the one-device loss sum_r S_r / T:
    - an engine that sums replicas' gradients (psum; jit over a sharded batch): 1 / T;
    - an engine that averages them (DDP's all-reduce mean, tf.distribute's SUM over a loss
      pre-divided by the replica count): replicas / T.
    An all-pad global batch has loss 0, as the oracle's (max(T, 1))."""
    return (replicas if engine_averages else 1) / max(global_tokens, 1)
