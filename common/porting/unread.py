"""The outside models that config.json can name but `rosetta convert` does not read yet, each
with the parts of it that the spec lacks: a refusal names what is missing, not only the family
(docs/RELIABILITY.md, "Bad input is one line"; the llama3-rope and sliding-window refusals of
common/porting/llama.py do the same for one key).

The kinds that are read come from their importers (`READ_MODEL_TYPES`); a model_type that is in
neither table is named as unknown, with the list of those that are read. Each entry is
transformers' `model_type` string, the family's name as its users write it, and the features
the spec lacks, from the family's modeling file in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable

# model_type -> the importer (--from) that reads it.
READ_MODEL_TYPES: dict[str, str] = {
    "marian": "marian",
    "bert": "bert",
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
}

# model_type -> (family, what the spec lacks to compute it).
UNREAD: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma": (
        "Gemma",
        ("RMSNorm scaled by (1 + w)", "embeddings times sqrt(d_model)", "a tanh-GELU gate"),
    ),
    "gemma2": (
        "Gemma 2",
        (
            "RMSNorm scaled by (1 + w)",
            "soft-capped scores and logits",
            "norms after each sublayer",
            "query_pre_attn_scalar",
            "sliding windows on alternating layers",
        ),
    ),
    "gemma3_text": (
        "Gemma 3",
        ("RMSNorm on q and k", "local and global rotary bases", "sliding windows"),
    ),
    "gemma3": ("Gemma 3", ("a vision tower", "RMSNorm on q and k", "sliding windows")),
    "qwen3": ("Qwen3", ("RMSNorm on each head's q and k",)),
    "mixtral": ("Mixtral", ("mixture-of-experts feed-forward (softmax router, top-k)",)),
    "qwen2_moe": (
        "Qwen2-MoE",
        ("mixture-of-experts feed-forward", "a shared expert with a sigmoid gate"),
    ),
    "qwen3_moe": (
        "Qwen3-MoE",
        ("mixture-of-experts feed-forward", "RMSNorm on each head's q and k"),
    ),
    "phi3": ("Phi-3", ("fused qkv_proj and gate_up_proj", "longrope rotary scaling")),
    "phi": ("Phi-2", ("partial rotary", "the parallel block")),
    "starcoder2": ("Starcoder2", ("sliding-window attention",)),
    "t5": ("T5", ("relative position buckets", "unscaled attention scores")),
    "mt5": ("mT5", ("relative position buckets", "unscaled attention scores")),
    "umt5": ("UMT5", ("relative position buckets in every layer",)),
    "bart": ("BART", ("learned positions offset by 2", "layernorm_embedding")),
    "mbart": ("mBART", ("learned positions offset by 2", "layernorm_embedding")),
    "pegasus": ("Pegasus", ("pre-norm Marian stacks with final norms",)),
    "m2m_100": ("M2M100/NLLB", ("fairseq sinusoidal positions offset by 2",)),
    "fsmt": ("FSMT", ("its own position layout",)),
    "roberta": ("RoBERTa", ("positions starting at pad_token_id + 1",)),
    "xlm-roberta": ("XLM-RoBERTa", ("positions starting at pad_token_id + 1",)),
    "distilbert": ("DistilBERT", ("its own tensor names, without token types",)),
    "electra": ("ELECTRA", ("a projection from the embedding size to the hidden size",)),
    "albert": ("ALBERT", ("a factorised embedding", "one layer's weights shared by all")),
    "mpnet": ("MPNet", ("relative position buckets in an encoder",)),
    "deberta-v2": ("DeBERTa-v2", ("disentangled relative attention",)),
    "deberta": ("DeBERTa", ("disentangled relative attention",)),
    "modernbert": (
        "ModernBERT",
        ("rotary positions in an encoder", "alternating local and global attention"),
    ),
    "gpt_neox": ("GPT-NeoX", ("partial rotary", "the parallel block", "fused query_key_value")),
    "gptj": ("GPT-J", ("partial interleaved rotary", "the parallel block")),
    "gpt_neo": ("GPT-Neo", ("local attention on alternating layers", "unscaled scores")),
    "stablelm": ("StableLM", ("partial rotary",)),
    "falcon": ("Falcon", ("the parallel block", "fused multi-query projections")),
    "olmo2": ("OLMo 2", ("RMSNorm on the whole q and k", "norms after the sublayers")),
    "granite": ("Granite", ("embedding, residual, attention and logit multipliers",)),
    "cohere": ("Cohere", ("LayerNorm without bias", "logit_scale", "the parallel block")),
    "gpt_bigcode": ("GPTBigCode", ("a fused multi-query c_attn",)),
    "opt": ("OPT", ("learned positions offset by 2", "project_in and project_out")),
    "bloom": ("BLOOM", ("ALiBi position biases", "a LayerNorm on the embeddings")),
}


def _listed(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def lacking(model_type: object) -> str:
    """'; the spec lacks FEATURES' for a family of UNREAD, else '' (appended to a refusal)."""
    if not isinstance(model_type, str) or model_type not in UNREAD:
        return ""
    family, features = UNREAD[model_type]
    return f"; {family} is not read yet: the spec lacks {', '.join(features)}"


def unread_model_type(model_type: object) -> str:
    """The one-line refusal of a config.json model_type that no importer reads: what the spec
    lacks for a known family, or that the name is unknown, and the model types that are read."""
    read = f"the model types read are {_listed(READ_MODEL_TYPES)}"
    if model_type is None:
        return f"config.json names no model_type; {read} (or give --from)"
    if isinstance(model_type, str) and model_type in UNREAD:
        family, features = UNREAD[model_type]
        return (
            f"model_type {model_type!r} ({family}) is not read yet: the spec lacks "
            f"{', '.join(features)}; {read}"
        )
    return f"model_type {model_type!r} is not a model type rosetta knows; {read}"
