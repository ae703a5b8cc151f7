"""Forward-pass speed of torch_impl against torch.nn.Transformer, side by side on the CPU.

Workload: the base model with a 32000-token vocabulary, batch 8, source and target length 128
with ragged padding, float32, eval mode under torch.inference_mode. Contenders, timed in
alternation (benchmarks/harness.py): ours on the fused SDPA path, ours returning every attention
map (explicit path), the peer (nn.Transformer with the same embeddings, sinusoids, masks and
output projection), and a 2048 x 2048 matmul as the machine's ceiling.

    python -m benchmarks.bench_torch_impl_forward [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import warnings

import torch
from torch import Tensor, nn

from benchmarks.harness import (
    BASE_WORKLOAD,
    base_benchmark_config,
    forward_flops,
    matmul_flops,
    report_line,
    time_side_by_side,
)
from common.config import TransformerConfig
from common.init import init_weights
from common.inputs import ragged_batch
from torch_impl.model import Transformer, sinusoidal_positions
from torch_impl.weights import load_canonical

MATMUL_N = 2048


class Peer(nn.Module):
    """torch.nn.Transformer as its users write it: scaled nn.Embedding + the same sinusoids, then
    an output nn.Linear. nn.Transformer takes masks as True = *masked*: inverted here only."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.c = c
        self.src_embedding = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embedding = nn.Embedding(c.tgt_vocab_size, c.d_model)
        self.register_buffer("pe", sinusoidal_positions(c.max_len, c.d_model).float())
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    # nn.Transformer's encoder fast path packs the padded source into a nested tensor (its
    # default, kept: it is the peer as its users run it) and warns that the API is a prototype.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    torch.manual_seed(0)
    c = base_benchmark_config()
    w = BASE_WORKLOAD
    ours = Transformer(c).eval()
    load_canonical(ours, {k: torch.from_numpy(v) for k, v in init_weights(c, 0).items()})
    peer = Peer(c).eval()
    src, tgt = (
        torch.from_numpy(a) for a in ragged_batch(c, w["batch"], w["src_len"], w["tgt_len"])
    )
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)

    def ours_fused() -> Tensor:
        return ours(src, tgt)

    def ours_with_attention() -> Tensor:
        memory, _, _ = ours.encode(src, need_weights=True)
        y, _, _, _ = ours.decode(tgt, memory, src, need_weights=True)
        return ours.logits(y)

    contenders = {
        "ours (fused SDPA)": ours_fused,
        "ours (attention maps returned)": ours_with_attention,
        "peer nn.Transformer": lambda: peer(src, tgt),
        f"matmul {MATMUL_N}x{MATMUL_N}": lambda: a @ b,
    }
    with torch.inference_mode():
        times = time_side_by_side(contenders, repeats=args.repeats, progress=not args.json)

    flops = forward_flops(c, w["batch"], w["src_len"], w["tgt_len"])
    ceiling = matmul_flops(MATMUL_N) / times[f"matmul {MATMUL_N}x{MATMUL_N}"] / 1e9
    peer_time = times["peer nn.Transformer"]
    result = {
        "workload": {**w, "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "median_s": times,
        "matmul_gflops": ceiling,
        "ratio_ours_over_peer": times["ours (fused SDPA)"] / peer_time,
        "ratio_ours_with_attention_over_peer": times["ours (attention maps returned)"] / peer_time,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {w}, float32, cpu")
    for name, seconds in times.items():
        work = matmul_flops(MATMUL_N) if name.startswith("matmul") else flops
        print(report_line(name, seconds, work, ceiling))
    print(f"ours / peer (fused):          {result['ratio_ours_over_peer']:.3f}  (target <= 1.15)")
    print(f"ours / peer (attention maps): {result['ratio_ours_with_attention_over_peer']:.3f}")
    return result


if __name__ == "__main__":
    main()
