"""The PyTorch Transformer on many devices: data parallelism with DistributedDataParallel (DDP)
and sharded parameters with FSDP2 (`fully_shard` on a DeviceMesh), over torch.distributed.

One process per device (a rank), as torch.distributed works: gloo between CPU processes, NCCL
between GPUs (one GPU per process), chosen from the device. The processes come from either
- `torchrun --nproc-per-node N script.py`, whose every process calls train_on_mesh or
  forward_on_mesh: each runs its own rank (torch.distributed.init_process_group reads RANK,
  WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment torchrun sets); or
- launch_local, for one machine (the tests, the command line): it starts the N processes through
  elastic_launch, the launcher API torchrun itself runs on, so each rank runs in the very
  environment torchrun gives it (a free localhost port for the rendezvous included), and the
  ranks' return values come back to the caller. The ranks are forked from a forkserver that has
  imported this module once, so a launch does not pay torch's import in every rank.

The mesh (transformer_rosetta.spec.mesh.MeshShape, data x model) maps onto the engines so:
- model == 1: DDP over the `data` ranks. Each replica runs replica_rows of every global batch and
  DDP all-reduces the gradients to their mean during backward.
- model > 1: FSDP2, each encoder and decoder layer one `fully_shard` group and the root (the
  embeddings, the output projection, the final norms) another, the documented pattern. With
  data == 1 the parameters, gradients and Adam's moments are sharded over the `model` ranks
  (dim 0 of each tensor, padded where it does not divide); with data > 1 the 2-D mesh gives HSDP:
  replicated over `data`, sharded over `model`. FSDP2 shards the memory, not the arithmetic
  (ZeRO-3): before each group runs, its parameters are all-gathered whole, so every
  `model` rank of a replica runs that replica's rows through whole layers, and FSDP2 averages the
  gradients over all data x model ranks (reduce-scatter, then all-reduce over `data`). Splitting
  the heads' arithmetic (Megatron-style) would be torch.distributed.tensor.parallel, another
  engine. A tied or shared embedding stays one Parameter: FSDP2 shards it once, in the root group,
  and re-registers the one sharded Parameter under every module that holds it.
FSDP2 runs on CPU here: torch 2.13's gloo has the all-gather and reduce-scatter it needs, float64
included (parity_tests/distributed/test_torch_distributed.py trains and runs it).

The loss (section 5.4) is a mean over the GLOBAL batch's non-pad targets. Both engines average
the ranks' gradients, so each rank's loss is its token SUM (train.summed_loss) times
replica_loss_scale(global tokens, data replicas, engine_averages=True) = data / T: the average
over the ranks is then the gradient of sum_r S_r / T, the one-device loss. Each replica dividing
by its own token count instead (the "naive" per-replica mean) computes another loss on a ragged
batch; `local_mean=True` keeps that variant so that the tests can show it.

Dropout: the parity tests use dropout 0. With dropout > 0 a run trains, but its masks are not a
one-device run's: each data replica draws its own from torch's generator seeded with its replica
index, so the `model` ranks of one replica draw the same masks (they compute the same rows).

A rank that raises or dies stops the run: the elastic agent ends the other ranks; launch_local
then raises RankFailed, naming the rank and its error in one line (torchrun reports the failed
rank itself), and no weights come back, so nothing is written. A rank left waiting on a peer
that never arrives (a peer on another machine lost without its agent noticing) gives up after
COLLECTIVE_TIMEOUT.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import inspect
import logging
import multiprocessing
import os
import signal
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.fsdp import fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from transformer_rosetta.errors import InputError, RosettaError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs, check_trainable
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.mesh import (
    MESH_AXES,
    MeshShape,
    check_mesh,
    replica_loss_scale,
    replica_rows,
    target_tokens,
)
from transformer_rosetta.spec.results import ForwardOutput
from transformer_rosetta.torch_impl.model import Transformer
from transformer_rosetta.torch_impl.precision import matmul_precision
from transformer_rosetta.torch_impl.train import make_optimizer, noam_schedule, summed_loss
from transformer_rosetta.torch_impl.weights import (
    TORCH_DTYPES,
    canonical_from_state_dict,
    load_canonical,
)

# The dtypes a mesh run takes: the two parity tiers.
MESH_DTYPES = ("float32", "float64")
# How long a rank waits in one collective for a peer before it gives up with an error. Modest:
# the steps here take well under a second; a lost peer must not hang the others for torch's
# default of ten minutes (gloo) or more.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)

T = TypeVar("T")


def train_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    dtype: str = "float32",
    warmup: int,
    factor: float = 1.0,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Adam steps on `mesh` with the framework's own engine, as train.py's train_step takes them
    (the paper's Adam, the Noam rate of each step counted from 1): every data replica takes
    replica_rows of each GLOBAL batch and divides its token sum by the batch's global token count
    (transformer_rosetta.spec.mesh), and the model shards split the parameters. The mesh and every
    batch are checked before anything starts. Returns (each step's global loss, taken before its
    update; the final weights as canonical numpy arrays, gathered whole): the one-device run's
    within the parity bounds (docs/DISTRIBUTED.md). Dropout: see the module docstring."""
    check_trainable(config)
    checked = [check_inputs(config, src, tgt) for src, tgt in batches]
    check_request(config, [tgt.shape[0] for _, tgt in checked], mesh, dtype)
    args = (config, dict(weights), checked, mesh)
    if dist.is_torchelastic_launched():  # idiom: under torchrun, this process is one rank
        result = train_rank(*args, dtype=dtype, warmup=warmup, factor=factor)
    else:
        result = launch_local(_train_rank_positional, mesh.size, *args, dtype, warmup, factor)[0]
    return result.losses, result.weights


def forward_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray,
    mesh: MeshShape,
    *,
    dtype: str = "float32",
) -> ForwardOutput:
    """The model's forward on `mesh` (eval mode, the explicit attention path), its parameters
    sharded over mesh.model and the batch's rows over mesh.data, gathered to numpy: the logits,
    the encoder output and every attention map, no hidden states."""
    src, tgt_in = check_inputs(config, src, tgt_in)
    rows = (tgt_in if tgt_in is not None else src).shape[0]
    check_request(config, [rows], mesh, dtype)
    args = (config, dict(weights), src, tgt_in, mesh, dtype)
    if dist.is_torchelastic_launched():
        return forward_rank(*args)
    return launch_local(forward_rank, mesh.size, *args)[0]


class RankFailed(RosettaError, RuntimeError):
    """A process of a distributed run raised or died. The others were stopped and no result came
    back, so nothing was written."""


# -- checks, made before any process starts -------------------------------------------------------


def available_devices() -> int:
    """The devices a mesh may use: the GPUs, or on a machine without one the CPU cores this
    process may run on (one gloo process per core; more would only share cores)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_request(
    config: TransformerConfig,
    batch_rows: Sequence[int],
    mesh: MeshShape,
    dtype: str,
) -> None:
    """A mesh run's problems, each an InputError of one line, before anything starts: the dtype,
    a mesh that does not divide each batch (`batch_rows`: each batch's row count), the heads or
    the feed-forward, and more ranks than devices (launched locally) or than torchrun started."""
    if dtype not in MESH_DTYPES:
        raise InputError(f"--dtype {dtype}: a mesh run takes {' or '.join(MESH_DTYPES)}")
    if dist.is_torchelastic_launched():
        started = int(os.environ["WORLD_SIZE"])
        if started != mesh.size:
            raise InputError(
                f"--mesh {mesh}: needs {mesh.size} processes, and torchrun started {started}"
            )
        devices = None  # torchrun placed the processes, on this machine or several
    else:
        devices = available_devices()
    for rows in sorted(set(batch_rows)) or [None]:
        check_mesh(mesh, config, batch=rows, devices=devices)


# -- one rank -------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankResult:
    """What one rank of train_on_mesh ends with: every step's global loss, the final weights
    gathered whole (canonical numpy arrays), and the shape each parameter has on this rank, by
    state_dict key (a DTensor's local shard under FSDP2, the whole tensor under DDP)."""

    losses: list[float]
    weights: dict[str, np.ndarray]
    shards: dict[str, tuple[int, ...]]


def train_rank(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    dtype: str = "float32",
    warmup: int,
    factor: float = 1.0,
    local_mean: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> RankResult:
    """train_on_mesh's work in one rank (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
    environment, as torchrun and launch_local set them). The step is train.train_step's: the Noam
    rate of the step (counted from 1) written into torch's Adam, the loss taken before the
    update; only the loss differs (see the module docstring). `local_mean` divides each replica's
    token sum by its own token count instead of the global one: the naive per-replica mean, kept
    to show what it costs. `on_step(step)` runs before each step (progress, a test's fault)."""
    device = join_process_group()
    with matmul_precision("highest"), _fsdp_views_expected():
        grid = _device_mesh(device, mesh)
        replica = grid.get_local_rank("data")
        torch.manual_seed(replica)  # dropout's masks: one stream per data replica
        module = _build(config, weights, dtype, device)
        engine = _distribute(module, grid, mesh, device)
        optimizer = make_optimizer(module)
        schedule = noam_schedule(config.d_model, warmup, factor)
        module.train()
        losses = []
        for step, (src, tgt) in enumerate(batches, start=1):
            if on_step is not None:
                on_step(step)
            rows = replica_rows(tgt.shape[0], mesh.data, replica)
            src_t, tgt_in_t, tgt_t = _batch(config, src, tgt, rows, device)
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            optimizer.zero_grad(set_to_none=True)
            logits = engine(src_t, tgt_in_t)["logits"]  # (B / data, T, V)
            summed, own = summed_loss(logits, tgt_t, config.pad_id, config.label_smoothing)
            # The engines average the ranks' gradients: a loss of S_r * data / T makes that
            # average the gradient of sum_r S_r / T (replica_loss_scale). The naive variant:
            # S_r / T_r, the replica's own mean, which the average does not make global.
            if local_mean:
                scale = 1.0 / max(own, 1)
            else:
                tokens = target_tokens(tgt, config.pad_id)
                scale = replica_loss_scale(tokens, mesh.data, engine_averages=True)
            loss = summed * scale
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        # The global loss of each step: the mean of the ranks' losses (a replica's `model` ranks
        # hold equal ones), one all-reduce for all steps at the end.
        total = torch.stack(losses) if losses else torch.zeros(0, dtype=TORCH_DTYPES[dtype])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        global_losses = [float(x) / dist.get_world_size() for x in total.cpu()]
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        canonical = canonical_from_state_dict(config, state)
        return RankResult(
            losses=global_losses,
            weights={name: _numpy(t) for name, t in canonical.items()},
            shards={key: _local_shape(p) for key, p in module.state_dict(keep_vars=True).items()},
        )


def forward_rank(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    mesh: MeshShape,
    dtype: str = "float32",
) -> ForwardOutput:
    """forward_on_mesh's work in one rank: this data replica's rows through the model (sharded by
    FSDP2 when mesh.model > 1), then every replica's rows gathered, in order, on every rank."""
    device = join_process_group()
    with matmul_precision("highest"), _fsdp_views_expected(), torch.no_grad():
        grid = _device_mesh(device, mesh)
        replica = grid.get_local_rank("data")
        module = _build(config, weights, dtype, device).eval()
        if mesh.model > 1:
            _shard(module, grid, mesh)
        batch = (tgt_in if tgt_in is not None else src).shape[0]
        rows = replica_rows(batch, mesh.data, replica)
        ids = [None if a is None else torch.from_numpy(a[rows]).to(device) for a in (src, tgt_in)]
        out = module(*ids, return_attention=True)
        mine = ForwardOutput.from_model(out, _numpy, attention=True, hidden_states=False)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    # Rank d * model is the first of replica d's `model` ranks (init_device_mesh is row-major).
    return _concat_rows([every[d * mesh.model] for d in range(mesh.data)])


def _train_rank_positional(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    dtype: str,
    warmup: int,
    factor: float,
) -> RankResult:
    """train_rank with positional arguments only: elastic_launch passes no keywords."""
    return train_rank(config, weights, batches, mesh, dtype=dtype, warmup=warmup, factor=factor)


# -- the pieces -----------------------------------------------------------------------------------


def _device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK, one per process), else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    # The ranks on one machine share its cores rather than each taking all of them (what
    # torchrun's OMP_NUM_THREADS=1 default is for), unless OMP_NUM_THREADS says otherwise.
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, available_devices() // local))
    return torch.device("cpu")


def join_process_group() -> torch.device:
    """This rank's device, with the default process group up: NCCL between GPUs, gloo between
    CPU processes, with a COLLECTIVE_TIMEOUT on every collective. Made on first use, it then
    stays for the process's lifetime, so that one torchrun job can make several mesh runs (its
    rendezvous store cannot form a second default group after the first is destroyed); it is
    destroyed when the process exits (launch_local's ranks: when their function returns)."""
    device = _device()
    if not dist.is_initialized():
        # idiom: init_process_group reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env://)
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        atexit.register(_leave_process_group)
    return device


def _leave_process_group() -> None:
    """The default process group destroyed, if it is up."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _in_own_group(fn: Callable[..., T], *args: Any) -> T:
    """What launch_local runs in each rank: fn(*args) in a process group made for it and
    destroyed after it, error or not."""
    join_process_group()
    try:
        return fn(*args)
    finally:
        _leave_process_group()


@contextlib.contextmanager
def _fsdp_views_expected() -> Iterator[None]:
    """FSDP2's warning that the model returned a view (F.linear's logits are one) silenced for
    the block: it warns of in-place edits of the outputs, and nothing here edits them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        yield


def _device_mesh(device: torch.device, mesh: MeshShape) -> DeviceMesh:
    """The ranks as a (data, model) DeviceMesh, row-major: rank = replica * model + shard."""
    return init_device_mesh(device.type, mesh.shape, mesh_dim_names=MESH_AXES)


def _build(
    config: TransformerConfig, weights: Mapping[str, np.ndarray], dtype: str, device: torch.device
) -> Transformer:
    """The whole model in `dtype` on `device`, holding `weights`, as the backend builds it."""
    module = Transformer(config).to(device=device, dtype=TORCH_DTYPES[dtype])
    load_canonical(
        module, {n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in weights.items()}
    )
    return module


def _shard(module: Transformer, grid: DeviceMesh, mesh: MeshShape) -> None:
    """FSDP2 in place, bottom-up: each encoder and decoder layer one group, the root (embeddings,
    output projection, final norms) the last. Over the `model` ranks alone when data == 1, else
    HSDP over the 2-D mesh (replicated over `data`, sharded over `model`)."""
    # idiom: FSDP2 (ZeRO-3) shards storage and all-gathers each group whole before it runs; the
    # mesh's `model` axis is its shard axis, and a 2-D mesh makes it HSDP
    over = grid["model"] if mesh.data == 1 else grid
    for stack in (module.encoder, module.decoder):
        for layer in stack.layers if stack is not None else ():
            fully_shard(layer, mesh=over)
    fully_shard(module, mesh=over)


def _distribute(
    module: Transformer, grid: DeviceMesh, mesh: MeshShape, device: torch.device
) -> nn.Module:
    """The module the steps call: FSDP2's (the module itself, sharded in place) when mesh.model
    > 1, else a DDP wrapper over the data ranks."""
    if mesh.model > 1:
        _shard(module, grid, mesh)
        return module
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=grid.get_group("data"),
        **no_forward_buffer_sync(DistributedDataParallel),
    )


def no_forward_buffer_sync(ddp: type) -> dict[str, bool]:
    """DDP's keyword that turns off the buffer broadcast before each forward: the only buffers
    are the position tables (the sinusoids or the rotary cos and sin), functions of the config,
    equal on every rank.

    torch 2.13 named it `forward_sync_buffers` and deprecated `broadcast_buffers`; older torch
    (pyproject allows >= 2.4; the GPU image has 2.11) knows only `broadcast_buffers`, which also
    skips the broadcast at construction, harmless for a buffer equal on every rank.
    """
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _batch(
    config: TransformerConfig,
    src: np.ndarray | None,
    tgt: np.ndarray,
    rows: slice,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(src, tgt_in, tgt) of this replica's `rows` on `device`: the decoder reads tgt shifted
    right behind BOS (teacher forcing); src is None for a decoder-only model."""
    tgt_in = shift_right(tgt, config.bos_id)
    return tuple(
        None if a is None else torch.from_numpy(np.ascontiguousarray(a[rows])).to(device)
        for a in (src, tgt_in, tgt)
    )


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A float32 or float64 tensor as a numpy copy on the host."""
    return t.detach().cpu().numpy().copy()


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of what this rank holds of `p`: a DTensor's local shard, else all of it."""
    return tuple((p.to_local() if isinstance(p, DTensor) else p).shape)


def _concat_rows(parts: Sequence[ForwardOutput]) -> ForwardOutput:
    """The data replicas' outputs, in replica order, as one ForwardOutput over the whole batch
    (every array's first axis is the batch's)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ForwardOutput):
        got = [getattr(p, f.name) for p in parts]
        if got[0] is None:
            values[f.name] = None
        elif isinstance(got[0], list):
            values[f.name] = [np.concatenate(layer) for layer in zip(*got, strict=True)]
        else:
            values[f.name] = np.concatenate(got)
    return ForwardOutput(**values)


# -- the local launcher ---------------------------------------------------------------------------


def launch_local(fn: Callable[..., T], nprocs: int, *args: Any) -> dict[int, T]:
    """Run fn(*args) in `nprocs` new processes on this machine as the ranks of one job, through
    elastic_launch (torchrun's launcher API: RANK, WORLD_SIZE, MASTER_ADDR and a free localhost
    MASTER_PORT set for each), and return every rank's return value by rank. `fn` must be
    importable by name (the ranks are not forks of the caller). The ranks' own output goes to
    log files that are removed afterwards. If a rank raises or dies, the agent ends the others
    and RankFailed names the rank that failed first and its error, in one line."""
    # idiom: forkserver with this module preloaded: the server imports torch once and forks
    # each rank from it, so a launch costs a fork (~0.3 s) rather than an interpreter that
    # imports torch (~3 s a rank). Unlike a fork of the caller it is safe in a caller that runs
    # threads, and the server never touches CUDA. A no-op once this process's server runs.
    multiprocessing.set_forkserver_preload([__name__])
    with tempfile.TemporaryDirectory(prefix="rosetta-ranks-") as logs_dir:
        logs = _ErrorFiles(log_dir=logs_dir, redirects=Std.ALL)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            logs_specs=logs,
            run_id=f"rosetta-{uuid.uuid4().hex}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone takes
            max_restarts=0,  # a failed step is not retried: the run stops
            monitor_interval=0.1,
            start_method="forkserver",
        )
        # The agent installs its own SIGINT/SIGTERM handlers (raising SignalException) and
        # leaves them: the caller's (the command line's clean stop) come back after the run.
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with _launcher_quiet():
                return elastic_launch(config, _in_own_group)(fn, *args)
        except ChildFailedError as exc:
            # The agent reports the first exit it sees, often a rank that lost its peer rather
            # than the peer that raised; every rank's error file says which came first.
            failures = dict(exc.failures)
            for rank, path in logs.error_files.items():
                if rank not in failures and os.path.isfile(path):
                    failures[rank] = ProcessFailure(rank, pid=-1, exitcode=1, error_file=path)
            what = _root_cause(failures, nprocs)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    raise RankFailed(f"{what}; the other ranks were stopped and no result was kept")


class _ErrorFiles(DefaultLogsSpecs):
    """The agent's default log files, remembering where each rank writes its error file."""

    error_files: dict[int, str] = {}

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        self.error_files = dict(dest.error_files)
        return dest


# What a rank reports when a peer's process is gone (gloo's and NCCL's words, and the agent's
# SIGTERM): the consequence of another rank's failure, not its cause.
_PEER_LOST = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "remote worker",
    "remote process",
    "communicator was aborted",
    "sigterm",
)


def _root_cause(failures: Mapping[int, ProcessFailure], nprocs: int) -> str:
    """Which rank caused the others' failures, and how, in words: the earliest failure that is
    not the loss of a peer (the error files time failures to the second, so a rank that raised
    and the peer that lost it often tie), then the lowest rank. When every failure is a lost
    peer, the rank that left no error at all died without raising one (a signal, os._exit)."""

    def lost_peer(failure: ProcessFailure) -> bool:
        return any(words in str(failure.message).lower() for words in _PEER_LOST)

    rank, failure = min(
        failures.items(), key=lambda item: (lost_peer(item[1]), item[1].timestamp, item[0])
    )
    line = _failure_line(failure.message, failure.exitcode)
    silent = [r for r in range(nprocs) if r not in failures]
    if lost_peer(failure) and silent:
        return (
            f"rank {silent[0]} of {nprocs} died without raising an error (a signal?), and rank "
            f"{rank} lost it: {line}"
        )
    return f"rank {rank} of {nprocs} failed: {line}"


def _failure_line(message: Any, exitcode: int) -> str:
    """One line for a failed rank: its exception's `Type: text` (the error file torch's elastic
    agent records), or the signal or exit code that ended it."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines or lines[0].startswith("To enable traceback"):
        return f"its process exited with code {exitcode}"
    return lines[0][:300]


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """The elastic agent's and torch.multiprocessing's log records silenced for the block: a
    failure reaches the caller as RankFailed's one line, not as the agent's log of it."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed", "torch.multiprocessing")]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)
