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

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, BertModel, MarianMTModel, PreTrainedModel


def load_bert(folder: str | Path) -> BertModel:
    """transformers' BertModel from a folder, in eval mode, in float32, without its pooler
    (not part of the spec)."""
    model = BertModel.from_pretrained(folder, dtype=torch.float32, add_pooling_layer=False)
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
    return MarianMTModel.from_pretrained(folder, dtype=torch.float32).eval()


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
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def causal_lm_logits(model: PreTrainedModel, tgt_in: np.ndarray, pad_id: int) -> np.ndarray:
    """The model's logits (B, T, V) with our mask: the keys holding pad_id masked, except position
    0 (the spec's decoder never masks it), positions 0 .. T-1 in every row (pads included)."""
    mask = tgt_in != pad_id
    mask[:, 0] = True
    with torch.inference_mode():
        out = model(
            input_ids=torch.from_numpy(np.asarray(tgt_in, np.int64)),
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
        )
    return out.logits.numpy()
