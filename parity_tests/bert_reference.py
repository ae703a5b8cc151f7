"""The reference a sentence embedding is checked against: transformers' BertModel in float64 on a
folder, as sentence-transformers' encode runs it. parity_tests/cli/test_embed.py compares with it, and
parity_tests/data/make_tiny_bert.py records it for the wheel's smoke test (which has no
transformers)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np


def sentence_transformers_reference(
    transformers: ModuleType, folder: Path, texts: Sequence[str], max_length: int
) -> np.ndarray:
    """BertModel float64 on the folder, as sentence-transformers' encode runs it: the tokenizer
    with padding and truncation to max_seq_length, the mean over the attention mask, the L2 norm."""
    import torch

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    model = transformers.BertModel.from_pretrained(folder).eval().double()
    with torch.no_grad():
        hidden = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=torch.zeros_like(batch["input_ids"]),
        ).last_hidden_state
    mask = batch["attention_mask"].double()[:, :, None]
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return (pooled / pooled.norm(dim=-1, keepdim=True)).numpy()
