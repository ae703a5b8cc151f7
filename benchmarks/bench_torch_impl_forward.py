"""Forward-pass speed of torch_impl against torch.nn.Transformer, side by side on the CPU.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) takes any config and
workload; `main()` runs the issues' one: the base model with a 32000-token vocabulary, batch 8,
source and target length 128 with ragged padding. Always float32, eval mode under
torch.inference_mode. Contenders, timed in alternation (benchmarks/harness.py): ours on the fused
SDPA path, ours returning every attention map (explicit path), the peer (nn.Transformer with the
same embeddings, sinusoids, masks and output projection), and a 2048 x 2048 matmul as the
machine's ceiling.

    python -m benchmarks.bench_torch_impl_forward [--repeats N] [--json]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.suite import MATMUL_N, alternate, module_main, summarise
from common.spec.config import TransformerConfig
from common.spec.inputs import ragged_batch
from common.weights.init import init_weights
from torch_impl.model import Transformer, sinusoidal_positions
from torch_impl.weights import load_canonical

WARMUP = 2


class Peer(nn.Module):
    """torch.nn.Transformer as its users write it: scaled nn.Embedding + the same sinusoids, then
    an output nn.Linear. nn.Transformer takes masks as True = *masked*: inverted here only."""

    def __init__(self, c: TransformerConfig, length: int) -> None:
        super().__init__()
        self.c = c
        self.src_embedding = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embedding = nn.Embedding(c.tgt_vocab_size, c.d_model)
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
        self.output = nn.Linear(c.d_model, c.tgt_vocab_size)

    def embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        return table(ids) * math.sqrt(self.c.d_model) + self.pe[: ids.shape[1]]

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_pad = src == self.c.pad_id
        tgt_pad = tgt_in == self.c.pad_id
        tgt_pad[:, 0] = False  # BOS stays visible, as in ours
        causal = nn.Transformer.generate_square_subsequent_mask(
            tgt_in.shape[1], dtype=torch.bool
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


PEER = "torch.nn.Transformer + nn.Embedding + output nn.Linear (eval, its nested-tensor fast path)"
LABELS = {
    "ours": "ours (fused SDPA)",
    "ours_attention": "ours (attention maps returned)",
    "peer": "peer nn.Transformer",
    "matmul": f"matmul {MATMUL_N}x{MATMUL_N}",
}


def measure(
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Median forward times of ours, ours with attention maps, the peer and the matmul, in one run.

    The contract of every bench module: see benchmarks/suite.py. Any config runs (the sizes and
    vocabularies are the config's); the timing is eval mode under torch.inference_mode.
    """
    # nn.Transformer's encoder fast path packs the padded source into a nested tensor (its
    # default, kept: it is the peer as its users run it) and warns that the API is a prototype.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    torch.manual_seed(0)
    ours = Transformer(config).eval()
    load_canonical(ours, {k: torch.from_numpy(v) for k, v in init_weights(config, 0).items()})
    peer = Peer(config, max(config.max_len, src_len, tgt_len)).eval()
    src, tgt = (torch.from_numpy(a) for a in ragged_batch(config, batch, src_len, tgt_len))
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)

    def ours_fused() -> Tensor:
        return ours(src, tgt)["logits"]

    def ours_with_attention() -> Tensor:
        return ours(src, tgt, return_attention=True)["logits"]

    contenders = {
        "ours": ours_fused,
        "ours_attention": ours_with_attention,
        "peer": lambda: peer(src, tgt),
        "matmul": lambda: a @ b,
    }
    with torch.inference_mode():
        times = alternate("torch", contenders, repeats, WARMUP, progress)
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
        workload={"threads": torch.get_num_threads()},
    )


def main(argv: list[str] | None = None) -> dict:
    return module_main(
        "torch", measure, argv, default_repeats=7, description=__doc__.split("\n\n")[0]
    )


if __name__ == "__main__":
    main()
