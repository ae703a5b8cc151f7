"""Forward-pass speed of torch_impl against torch.nn.Transformer, side by side on one device.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) is harness.measure with
this module's HOOK: any config, workload, device and precision; `main()` runs the standard
workload: the base model with a 32000-token vocabulary, batch 8, source and target length 128
with ragged padding. Eval mode under torch.inference_mode. Contenders, timed in alternation
(benchmarks/harness.py): ours on the fused SDPA path, ours returning every attention map
(explicit path), the peer (nn.Transformer with the same embeddings, sinusoids, masks and output
projection, holding our weights: its logits must be ours before it is timed), and an n x n matmul
as the device's ceiling. All four run in one dtype on one device under
transformer_rosetta.torch_impl.precision.matmul_precision; on a GPU each ends with
torch.cuda.synchronize(), so that a time is the work's and not its launch's.

    python -m transformer_rosetta.benchmarks.bench_torch_impl_forward [--repeats N] [--device D] [--precision P] [--json]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.benchmarks import harness
from transformer_rosetta.benchmarks.harness import Contenders, ForwardHook, matmul_size
from transformer_rosetta.benchmarks.suite import module_main
from transformer_rosetta.porting import nn_transformer
from transformer_rosetta.porting.table import from_canonical
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.torch_impl.model import sinusoidal_positions
from transformer_rosetta.torch_impl.precision import matmul_precision
from transformer_rosetta.torch_impl.weights import TORCH_DTYPES

WARMUP = 2


# The config's activation as nn.Transformer takes it: a name (its fast path's) or a callable.
ACTIVATIONS: Mapping[str, str | Callable[[Tensor], Tensor]] = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class Peer(nn.Module):
    """torch.nn.Transformer as its users write it: scaled nn.Embedding + the same sinusoids, then
    an output nn.Linear. Embeddings are shared and the output tied as the config says, the torch
    way (one module twice, `output.weight = embedding.weight`), so that the peer trains the same
    number of parameters as ours. nn.Transformer takes masks as True = *masked*: inverted here.

    Its layers are the config's (norm_first, activation, layer_norm_eps), and its stacks are
    given as custom_encoder and custom_decoder, the documented way to choose their final
    LayerNorm: nn.Transformer's own stacks always end in one, which a post-norm model without
    final_norm (the paper's) does not have. The sinusoids are a buffer that is not saved (they
    are computed), so that the state_dict is the nn-transformer format of porting/."""

    def __init__(self, c: TransformerConfig, length: int) -> None:
        super().__init__()
        self.c = c
        self.src_embedding = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embedding = (
            self.src_embedding if c.share_embeddings else nn.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.register_buffer(
            "pe",
            sinusoidal_positions(length, c.d_model, c.sinusoid_layout).float(),
            persistent=False,
        )
        pre_norm = c.norm_position == "pre"
        layer = dict(
            d_model=c.d_model,
            nhead=c.num_heads,
            dim_feedforward=c.d_ff,
            dropout=0.0,
            activation=ACTIVATIONS[c.activation],
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=pre_norm,
        )

        def final_norm() -> nn.LayerNorm | None:
            return nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.final_norm else None

        encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(**layer),
            c.num_encoder_layers,
            norm=final_norm(),
            # idiom: torch packs a padded source into a nested tensor only for post-norm layers
            # (and warns when asked to for pre-norm ones)
            enable_nested_tensor=not pre_norm,
        )
        decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(**layer), c.num_decoder_layers, norm=final_norm()
        )
        self.transformer = nn.Transformer(
            d_model=c.d_model,
            nhead=c.num_heads,
            custom_encoder=encoder,
            custom_decoder=decoder,
            batch_first=True,
        )
        self.output = nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        if c.tie_output:
            self.output.weight = self.tgt_embedding.weight

    def embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        return table(ids) * math.sqrt(self.c.d_model) + self.pe[: ids.shape[1]]

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_pad = src == self.c.pad_id
        tgt_pad = tgt_in == self.c.pad_id
        tgt_pad[:, 0] = False  # BOS stays visible, as in ours
        causal = nn.Transformer.generate_square_subsequent_mask(
            tgt_in.shape[1], device=src.device, dtype=torch.bool
        )  # True above the diagonal = masked
        y = self.transformer(
            self.embed(self.src_embedding, src),
            self.embed(self.tgt_embedding, tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.output(y)


def peer_lacks(c: TransformerConfig) -> list[str]:
    """What of `c` the Peer cannot express (harness.lacked_by_every_peer adds what no peer has)."""
    if c.head_dim * c.num_heads != c.d_model:
        return [
            f"key_dim {c.head_dim} (nn.MultiheadAttention splits d_model {c.d_model} into "
            f"{c.num_heads} heads of {c.d_model // c.num_heads})"
        ]
    return []


# The nn-transformer importer's table (porting/nn_transformer.py) read the other way: the Peer's
# keys are those of the wrapper that its docstring describes. Its fixed final_norm is a fact
# about files saved from nn.Transformer's own stacks; the Peer has the config's final norms.
PEER_TABLE = dataclasses.replace(nn_transformer.TABLE, fixed={"attention_bias": True})


def peer_from_canonical(
    c: TransformerConfig, weights: Mapping[str, np.ndarray], length: int
) -> Peer:
    """The Peer holding canonical `weights` (float32, on the CPU: move it with .to()), so that
    its logits can be checked against ours; sinusoids for `length` positions."""
    peer = Peer(c, length)
    state = {
        nn_transformer.PREFIX + key if key.startswith(("encoder.", "decoder.")) else key: (
            torch.from_numpy(value)
        )
        for key, value in from_canonical(PEER_TABLE, weights, c).items()
    }
    # A shared or tied matrix is written once, under its first name; the Peer holds its one
    # Parameter under each name.
    if c.share_embeddings:
        state.setdefault(nn_transformer.TARGET_EMBEDDING, state[nn_transformer.SOURCE_EMBEDDING])
    if c.tie_output:
        state.setdefault(nn_transformer.OUTPUT_WEIGHT, state[nn_transformer.TARGET_EMBEDDING])
    peer.load_state_dict(state)
    return peer


def synchronizer(device: str) -> Callable[[], None]:
    """What makes the host wait for the device's queued work: CUDA runs asynchronously."""
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


PEER = "torch.nn.Transformer + nn.Embedding + output nn.Linear (eval, its nested-tensor fast path)"
LABELS = {
    "ours": "ours (fused SDPA)",
    "ours_attention": "ours (attention maps returned)",
    "peer": "peer nn.Transformer",
}


def contenders(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray,
    tgt_in: np.ndarray,
    *,
    device: str,
    dtype: str,
    mode: str,
) -> Contenders:
    """The four contenders on `device` in `dtype`, each ending when its work on the device has,
    and the logits of ours and the peer. Ours is built by the adapter (torch_impl/backend.py) and
    timed through its module; the peer holds the same weights."""
    # nn.Transformer's encoder fast path packs the padded source into a nested tensor (its
    # default, kept: it is the peer as its users run it) and warns that the API is a prototype.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    torch.manual_seed(0)  # the matmul's operands
    model = get_backend("torch").build(config, weights, dtype=dtype, device=device, precision=mode)
    ours = model.module
    tensor_dtype = TORCH_DTYPES[dtype]
    length = max(config.max_len, src.shape[1], tgt_in.shape[1])
    peer = peer_from_canonical(config, weights, length)
    peer = peer.to(device=device, dtype=tensor_dtype).eval()
    src_t, tgt_t = (torch.from_numpy(x).to(device) for x in (src, tgt_in))
    n = matmul_size(device, dtype)
    a = torch.randn(n, n, device=device, dtype=tensor_dtype)
    b = torch.randn(n, n, device=device, dtype=tensor_dtype)
    sync = synchronizer(device)

    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: (fn(), sync())

    def logits(fn: Callable[[], Tensor]) -> Callable[[], np.ndarray]:
        return lambda: fn().float().cpu().numpy()

    return Contenders(
        ours=timed(lambda: ours(src_t, tgt_t)["logits"]),
        ours_attention=timed(lambda: ours(src_t, tgt_t, return_attention=True)["logits"]),
        peer=timed(lambda: peer(src_t, tgt_t)),
        matmul=timed(lambda: a @ b),
        matmul_n=n,
        ours_logits=logits(lambda: ours(src_t, tgt_t)["logits"]),
        peer_logits=logits(lambda: peer(src_t, tgt_t)),
    )


@contextlib.contextmanager
def running(device: str, mode: str) -> Iterator[None]:
    """Eval under torch.inference_mode, at matmul precision `mode`."""
    with torch.inference_mode(), matmul_precision(mode):
        yield


def release(device: str) -> None:
    """Return torch's cached GPU memory, for the framework that runs next."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


HOOK = ForwardHook(
    framework="torch",
    version=f"torch {torch.__version__}",
    peer=PEER,
    labels=LABELS,
    warmup=WARMUP,
    peer_lacks=peer_lacks,
    build=contenders,
    running=running,
    workload=lambda device: {"threads": torch.get_num_threads()},
    release=release,
)


# The interface of every bench module (benchmarks/suite.py): the one harness.measure, with
# this framework's hook.
measure = functools.partial(harness.measure, HOOK)


def main(argv: list[str] | None = None) -> dict:
    return module_main(
        "torch", measure, argv, default_repeats=7, description=__doc__.split("\n\n")[0]
    )


if __name__ == "__main__":
    main()
