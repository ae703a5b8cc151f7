"""Write parity_tests/data/tiny-bert/, a sentence-transformers BERT folder small enough to commit
(about 100 KB), and parity_tests/data/tiny-bert-expected.json, transformers' embeddings of a few
texts through it. CI's wheel smoke test converts the folder and embeds those texts in a clean
venv without transformers, and compares with the stored numbers; parity_tests/cli/test_embed.py
checks the stored numbers against transformers itself where it is installed.

The weights are seeded random draws, wide enough that every tensor matters (a dropped bias, a
swapped matrix or a lost LayerNorm gain changes the embedding by far more than the bound), not
BERT's init (zero biases, unit gains, 0.02 weights: a near-constant model that hides such slips).
The vocabulary is a small lower-cased WordPiece one, so that words split into pieces and unknown
characters give [UNK]. Run from the repository root:

    .venv/bin/python -m parity_tests.data.make_tiny_bert
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizer

from parity_tests.bert_reference import sentence_transformers_reference

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "tiny-bert"
EXPECTED = HERE / "tiny-bert-expected.json"
SEED = 0
MAX_SEQ_LENGTH = 24  # sentence-transformers' cut, below the 64 positions so that it shows

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the an cat dog sat on mat runs in park hello world is and of to it this that sentence first "
    "second one two good bad happy day sun rain bird tree blue red big small cafe music book read"
).split()
PIECES = ["##ed", "##ing", "##er", "##ly", "##es", "##ion", "##est"]
VOCAB = [
    *SPECIALS,
    *".,!?'-",
    *string.digits,
    *string.ascii_lowercase,
    *(f"##{c}" for c in string.ascii_lowercase),
    *WORDS,
    *PIECES,
]
assert len(set(VOCAB)) == len(VOCAB) == 120, "each token once: a repeated line is unreachable"

# Mixed lengths; accents (stripped by the lower-casing normalizer), unknown characters ([UNK]),
# pieces, and one text longer than MAX_SEQ_LENGTH tokens, which is cut.
TEXTS = [
    "The cat sat on the mat.",
    "A dog runs in the park!",
    "Hello, world",
    "Café music: reading books is good.",
    "東京 and 🍕 are unknown here",
    "",
    "the sun and the rain and the birds and the trees and the blue sky and the red books and "
    "the happy days of music",
]

CONFIG = {
    "vocab_size": len(VOCAB),
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
}

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
POOLING = {
    "word_embedding_dimension": CONFIG["hidden_size"],
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": True,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": False,
    "include_prompt": True,
}


def seeded_model() -> BertModel:
    """BertModel with every parameter drawn: matrices N(0, 0.2^2), biases N(0, 0.1^2),
    LayerNorm gains 1 + N(0, 0.1^2), embeddings N(0, 0.5^2)."""
    torch.manual_seed(SEED)
    model = BertModel(BertConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embeddings" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def write_folder() -> None:
    if FOLDER.exists():
        shutil.rmtree(FOLDER)
    FOLDER.mkdir(parents=True)
    seeded_model().save_pretrained(FOLDER)
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=64)
    tokenizer.save_pretrained(FOLDER)
    (FOLDER / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB), encoding="utf-8")
    (FOLDER / "modules.json").write_text(json.dumps(MODULES, indent=2) + "\n")
    (FOLDER / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}, indent=2) + "\n"
    )
    (FOLDER / "1_Pooling").mkdir()
    (FOLDER / "1_Pooling" / "config.json").write_text(json.dumps(POOLING, indent=2) + "\n")


def reference_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    """BertModel (float64) on the folder, mean over the attention mask, then the L2 norm: what
    sentence-transformers' Transformer, Pooling and Normalize modules compute."""
    import transformers

    return sentence_transformers_reference(transformers, folder, texts, MAX_SEQ_LENGTH)


def main() -> None:
    write_folder()
    embeddings = reference_embeddings(FOLDER, TEXTS)
    record = {
        "about": "BertModel float64 on tiny-bert, mean pooling, L2 norm (make_tiny_bert.py)",
        "max_seq_length": MAX_SEQ_LENGTH,
        "texts": TEXTS,
        "embeddings": embeddings.tolist(),
    }
    EXPECTED.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in FOLDER.rglob("*") if p.is_file())
    print(f"wrote {FOLDER} ({size:,} bytes) and {EXPECTED}")


if __name__ == "__main__":
    main()
