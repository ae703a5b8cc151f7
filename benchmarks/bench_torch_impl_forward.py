"""Forward-pass speed of torch_impl against torch.nn.Transformer, side by side on one device.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) takes any config,
workload, device and precision; `main()` runs the issues' workload: the base model with a
32000-token vocabulary, batch 8, source and target length 128 with ragged padding. Eval mode
under torch.inference_mode. Contenders, timed in alternation (benchmarks/harness.py): ours on the
fused SDPA path, ours returning every attention map (explicit path), the peer (nn.Transformer with
the same embeddings, sinusoids, masks and output projection), and an n x n matmul as the device's
ceiling. All four run in one dtype on one device under transformer_rosetta.torch_impl.model.matmul_precision; on a GPU
each ends with torch.cuda.synchronize(), so that a time is the work's and not its launch's.

    python -m transformer_rosetta.benchmarks.bench_torch_impl_forward [--repeats N] [--device D] [--precision P] [--json]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.benchmarks.harness import matmul_size
from transformer_rosetta.benchmarks.suite import alternate, module_main, summarise
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.precision import bench_setting
from transformer_rosetta.torch_impl.model import matmul_precision, sinusoidal_positions
from transformer_rosetta.torch_impl.weights import TORCH_DTYPES
from transformer_rosetta.weights.init import init_weights

WARMUP = 2


class Peer(nn.Module):
    """torch.nn.Transformer as its users write it: scaled nn.Embedding + the same sinusoids, then
    an output nn.Linear. Embeddings are shared and the output tied as the config says, the torch
    way (one module twice, `output.weight = embedding.weight`), so that the peer trains the same
    number of parameters as ours. nn.Transformer takes masks as True = *masked*: inverted here."""

    def __init__(self, c: TransformerConfig, length: int) -> None:
        super().__init__()
        self.c = c
        self.src_embedding = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embedding = (
            self.src_embedding if c.share_embeddings else nn.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.register_buffer(
            "pe", sinusoidal_positions(length, c.d_model, c.sinusoid_layout).float()
        )
        self.transformer = nn.Transformer(
            d_model=c.d_model,
            nhead=c.num_heads,
            num_encoder_layers=c.num_encoder_layers,
            num_decoder_layers=c.num_decoder_layers,
            dim_feedforward=c.d_ff,
            dropout=0.0,
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
    batch: int,
    src_len: int,
    tgt_len: int,
    device: str,
    dtype: str,
    mode: str,
) -> dict[str, Callable[[], None]]:
    """The four contenders on `device` in `dtype`, each ending when its work on the device has;
    ours is built by the adapter (torch_impl/backend.py) and timed through its module."""
    torch.manual_seed(0)
    model = get_backend("torch").build(
        config, init_weights(config, 0), dtype=dtype, device=device, precision=mode
    )
    ours = model.module
    tensor_dtype = TORCH_DTYPES[dtype]
    peer = Peer(config, max(config.max_len, src_len, tgt_len))
    peer = peer.to(device=device, dtype=tensor_dtype).eval()
    src, tgt = (
        torch.from_numpy(x).to(device) for x in ragged_batch(config, batch, src_len, tgt_len)
    )
    n = matmul_size(device, dtype)
    a = torch.randn(n, n, device=device, dtype=tensor_dtype)
    b = torch.randn(n, n, device=device, dtype=tensor_dtype)
    sync = synchronizer(device)

    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: (fn(), sync())

    return {
        "ours": timed(lambda: ours(src, tgt)["logits"]),
        "ours_attention": timed(lambda: ours(src, tgt, return_attention=True)["logits"]),
        "peer": timed(lambda: peer(src, tgt)),
        "matmul": timed(lambda: a @ b),
    }


def measure(
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Callable[[str], None] | None = None,
    *,
    device: str = "cpu",
    precision: str = "highest",
) -> dict:
    """Median forward times of ours, ours with attention maps, the peer and the matmul, in one run.

    The contract of every bench module: see benchmarks/suite.py. Any config runs (the sizes and
    vocabularies are the config's); the timing is eval mode under torch.inference_mode, on
    `device` (torch's name: "cpu", "cuda:0") at `precision` (a bench name: highest, tf32, bf16).
    """
    dtype, mode = bench_setting(precision)
    # nn.Transformer's encoder fast path packs the padded source into a nested tensor (its
    # default, kept: it is the peer as its users run it) and warns that the API is a prototype.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    runs = contenders(config, batch, src_len, tgt_len, device, dtype, mode)
    with torch.inference_mode(), matmul_precision(mode):
        times = alternate("torch", runs, repeats, WARMUP, progress)
    del runs  # the models and tensors: their memory goes back before the next framework runs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return summarise(
        framework="torch",
        version=f"torch {torch.__version__}",
        peer=PEER,
        labels=LABELS,
        times=times,
        config=config,
        batch=batch,
        src_len=src_len,
        tgt_len=tgt_len,
        repeats=repeats,
        device=device,
        precision=precision,
        matmul_n=matmul_size(device, dtype),
        workload={"threads": torch.get_num_threads()},
    )


def main(argv: list[str] | None = None) -> dict:
    return module_main(
        "torch", measure, argv, default_repeats=7, description=__doc__.split("\n\n")[0]
    )


if __name__ == "__main__":
    main()
