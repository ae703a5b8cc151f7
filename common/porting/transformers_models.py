"""transformers' own models, run on our probes: the other side of `convert --verify` for a Marian,
a BERT or a Llama-family folder (common/porting/verify.py).

This is the one module of the framework-free core that imports a framework. transformers' models
are torch modules, and loading and running them is neither the torch implementation's concern
(torch_impl/ holds our Transformer) nor a Backend's (which builds our model from canonical
weights). pyproject.toml's contract "the framework-free core imports no framework" names this
module as its one exception; verify.py imports it only when such a side runs, so importing
transformer_rosetta.porting imports no framework.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import utils as hub_utils
from transformers import AutoModelForCausalLM, BertModel, MarianMTModel, PreTrainedModel
from transformers.utils import logging as transformers_logging

from transformer_rosetta.files.os_names import library_path


@contextmanager
def quiet() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") and its warnings off while a model loads
    for `convert --verify`, whose own progress line says what runs; as they were afterwards
    (transformers' switch turns huggingface_hub's on and off with it, so both are put back)."""
    bars = transformers_logging.is_progress_bar_enabled()
    hub_bars_off = hub_utils.are_progress_bars_disabled()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
        if hub_bars_off:
            hub_utils.disable_progress_bars()
        else:
            hub_utils.enable_progress_bars()


def load_bert(folder: str | Path) -> BertModel:
    """transformers' BertModel from a folder, in eval mode, in float32, without its pooler
    (not part of the spec)."""
    with quiet(), library_path(folder) as name:  # transformers' torch.load takes UTF-8 names
        model = BertModel.from_pretrained(name, dtype=torch.float32, add_pooling_layer=False)
    return model.eval()


def bert_hidden_states(model: BertModel, src: np.ndarray, pad_id: int) -> np.ndarray:
    """BertModel's last hidden state (B, S, d) with the source's pads masked as keys and every
    token of segment 0, as the spec reads them."""
    ids = torch.from_numpy(np.asarray(src, np.int64))
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            attention_mask=(ids != pad_id).long(),
            token_type_ids=torch.zeros_like(ids),
        )
    return out.last_hidden_state.numpy().astype(np.float64)


def load_marian(folder: str | Path) -> MarianMTModel:
    """transformers' MarianMTModel from a folder, in eval mode, in float32."""
    with quiet(), library_path(folder) as name:  # transformers' torch.load takes UTF-8 names
        return MarianMTModel.from_pretrained(name, dtype=torch.float32).eval()


def marian_logits(model: MarianMTModel, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
    """MarianMTModel's logits (B, T, V) with our masks: the source's pads masked, and the
    decoder's pads masked except position 0 (the start token, which is Marian's pad id)."""
    pad = model.config.pad_token_id
    decoder_mask = tgt_in != pad
    decoder_mask[:, 0] = True
    with torch.inference_mode():
        out = model(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy((src != pad).astype(np.int64)),
            decoder_input_ids=torch.from_numpy(tgt_in),
            decoder_attention_mask=torch.from_numpy(decoder_mask.astype(np.int64)),
        )
    return out.logits.numpy()


def load_causal_lm(folder: str | Path) -> PreTrainedModel:
    """transformers' causal language model of a folder (LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM), in eval mode, in float32."""
    with quiet(), library_path(folder) as name:  # transformers' torch.load takes UTF-8 names
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()


def causal_lm_logits(model: PreTrainedModel, tgt_in: np.ndarray, pad_id: int) -> np.ndarray:
    """The model's logits (B, T, V) with our mask: the keys holding pad_id masked, except position
    0 (the spec's decoder never masks it), positions 0 .. T-1 in every row (pads included). A
    model without a pad token pads with its virtual pad (pad_id = the vocabulary size), which
    names no row of the embedding and embeds as the zero vector (docs/FORMAT.md, step 2): the
    model is then given those embeddings (inputs_embeds), its other rows looked up as it would."""
    mask = tgt_in != pad_id
    mask[:, 0] = True
    ids = torch.from_numpy(np.asarray(tgt_in, np.int64))
    with torch.inference_mode():
        table = model.get_input_embeddings()
        virtual = ids >= table.num_embeddings  # the virtual pad (check_inputs let only it past)
        inputs: dict[str, torch.Tensor] = {"input_ids": ids}
        if bool(virtual.any()):
            rows = table(ids.masked_fill(virtual, 0))
            inputs = {"inputs_embeds": rows.masked_fill(virtual[..., None], 0.0)}
        out = model(**inputs, attention_mask=torch.from_numpy(mask.astype(np.int64)))
    return out.logits.numpy()
