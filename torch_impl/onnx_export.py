"""ONNX graphs of the torch implementation, made by torch's own exporter (docs/PORTING.md, "ONNX").

Why torch's exporter rather than a graph written by hand with onnx.helper or onnxscript: the
exported graph is this module's forward pass, traced by torch.export (dynamo=True) and translated
op by op by onnxscript, so it cannot drift from the model the parity tests check; a hand-written
graph would be a fifth implementation to keep equal. The exporter's optimiser folds constants
(the sinusoid or rotary tables, the causal mask's ones) and its graphs pass onnx.checker.

Three graphs, each a file of its own:
- "forward": src (batch, src_len), tgt_in (batch, tgt_len) int64 -> logits (batch, tgt_len, V)
  and encoder_output (batch, src_len, d); with attention=True also every attention map under
  ForwardOutput.named()'s names (the explicit path; otherwise the fused one).
- "encoder": src -> the decoding cache of torch_impl/decode.py (init_cache, one beam), named
  "present.*": every decoder layer's cross keys and values and its empty self-attention buffers
  of max_steps positions, the memory mask, key_valid and index.
- "decoder_step": tokens (batch,) and the cache as "past.*" -> logits (batch, V) and the next
  cache as "present.*" (decode.decode_step): feed present back as past, one position a step.
Batch and lengths are dynamic (lengths up to max_len; max_steps is fixed at export); the masks are
built from the ids inside the graph, so a fully padded source row gives zero attention, not NaN.
"""

# idiom: only torch ships an ONNX exporter in its core (torch.onnx); Keras reaches ONNX through
# tf2onnx and JAX through jax2onnx, third-party converters of their own graphs. One exporter, of
# the implementation the other two are proven equal to, gives one graph for all three.

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from transformer_rosetta.spec.names import ONNX_CACHE_FIELDS, onnx_io_names
from transformer_rosetta.spec.results import ATTENTION_OUTPUTS
from transformer_rosetta.torch_impl import decode
from transformer_rosetta.torch_impl.model import LayerCache, Transformer


def _flat(cache: decode.Cache) -> tuple[Tensor, ...]:
    """The cache in transformer_rosetta.spec.names.onnx_cache_names' order."""
    layers = [getattr(layer, f) for layer in cache.layers for f in ONNX_CACHE_FIELDS]
    return (*layers, cache.memory_mask, cache.key_valid, cache.index)


class ForwardGraph(nn.Module):
    """Transformer.forward with tensor outputs: logits, encoder output (and attention maps)."""

    def __init__(self, model: Transformer, attention: bool) -> None:
        super().__init__()
        self.model, self.attention = model, attention

    def forward(self, src: Tensor, tgt_in: Tensor) -> tuple[Tensor, ...]:
        out = self.model(src, tgt_in, return_attention=self.attention)
        maps = []
        if self.attention:
            for _, field, _ in ATTENTION_OUTPUTS:
                maps += out[field]
        return (out["logits"], out["encoder_output"], *maps)


class EncoderGraph(nn.Module):
    """decode.init_cache for one beam: the encoder once, and the cache a first step reads."""

    def __init__(self, model: Transformer, max_steps: int) -> None:
        super().__init__()
        self.model, self.max_steps = model, max_steps

    def forward(self, src: Tensor) -> tuple[Tensor, ...]:
        return _flat(decode.init_cache(self.model, src, 1, self.max_steps))


class DecoderStepGraph(nn.Module):
    """decode.decode_step on a cache passed in as tensors, returned as the next cache."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, past: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        n = len(ONNX_CACHE_FIELDS)
        *layers, memory_mask, key_valid, index = past
        # decode_step writes its buffers in place; a graph's inputs are read-only, so it writes
        # copies (the export makes those copies its outputs).
        cache = decode.Cache(
            layers=[
                LayerCache(*(t.clone() for t in layers[i : i + n]))
                for i in range(0, len(layers), n)
            ],
            memory_mask=memory_mask,
            key_valid=key_valid.clone(),
            index=index,
        )
        logits, cache = decode.decode_step(self.model, tokens, cache)
        return (logits, *_flat(cache))


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx logs each stage, warns about optional packages it skips (torchvision), and
    onnx_ir's optimiser logs the initialisers it leaves alone: none of it is the user's concern."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def export_graph(
    model: Transformer,
    graph: str = "forward",
    *,
    attention: bool = False,
    max_steps: int | None = None,
) -> object:
    """The onnx.ModelProto of one graph of `model` (in eval mode, on its device, in its dtype).
    Inputs and outputs are named by transformer_rosetta.spec.names.onnx_io_names."""
    c = model.config
    inputs, outputs = onnx_io_names(c, graph, attention)
    steps = c.max_len if max_steps is None else max_steps
    model = model.eval()
    device = next(model.parameters()).device
    batch = torch.export.Dim("batch", min=1)
    src_len = torch.export.Dim("src_len", min=1, max=c.max_len)
    # The tracer's example: two rows, the second padded (sizes 0 and 1 would be specialised). Any
    # source id other than the pad will do: the last one (eos_id is the target's, and may lie
    # outside a smaller source vocabulary).
    real = c.src_vocab_size - 1 if c.src_vocab_size - 1 != c.pad_id else 0
    src = torch.full((2, 3), real, dtype=torch.int64, device=device)
    src[1, 1:] = c.pad_id
    if graph == "forward":
        wrapper: nn.Module = ForwardGraph(model, attention)
        tgt_in = torch.full((2, 4), c.bos_id, dtype=torch.int64, device=device)
        tgt_len = torch.export.Dim("tgt_len", min=1, max=c.max_len)
        args: tuple = (src, tgt_in)
        shapes: tuple = ({0: batch, 1: src_len}, {0: batch, 1: tgt_len})
    elif graph == "encoder":
        wrapper, args, shapes = EncoderGraph(model, steps), (src,), ({0: batch, 1: src_len},)
    else:
        wrapper = DecoderStepGraph(model)
        with torch.no_grad():
            past = _flat(decode.init_cache(model, src, 1, steps))
        tokens = torch.full((2,), c.bos_id, dtype=torch.int64, device=device)
        args = (tokens, past)
        # self_key, self_value (N, g, max_steps, d_k); cross_key, cross_value (N, g, S, d_k)
        per_layer = [{0: batch}, {0: batch}, {0: batch, 2: src_len}, {0: batch, 2: src_len}]
        cache = per_layer * c.num_decoder_layers + [{0: batch, 3: src_len}, {0: batch}, {}]
        shapes = ({0: batch}, tuple(cache))
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            args,
            dynamo=True,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=shapes,
            verbose=False,
        )
    proto = program.model_proto
    # The exporter labels every node with its torch origin (fx node, name scopes, a stack trace
    # holding this machine's paths): an aid for debugging the exporter, and 80% of a small
    # model's bytes. The graph is the same without them.
    for node in proto.graph.node:
        del node.metadata_props[:]
    return proto
