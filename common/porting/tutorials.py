"""The importers of the models that people train from four texts, each one a `Table`
(common/porting/table.py) of data:

- `annotated`: the Annotated Transformer (harvardnlp, "The Annotated Transformer"), PyTorch:
  `make_model(src_vocab, tgt_vocab, N, d_model, d_ff, h)`, pre-norm with its own LayerNorm
  (norm_kind "std_plus_eps"), a final norm on each stack, a Generator Linear with a bias.
- `pytorch-tutorial`: PyTorch's "Language Translation with nn.Transformer" `Seq2SeqTransformer`:
  the nn.Transformer rules (common/porting/nn_transformer.py) under `transformer.`, plus the
  tutorial's TokenEmbedding, PositionalEncoding buffer and generator.
- `tf-tutorial-v1`: the older TensorFlow tutorial ("Transformer model for language
  understanding"): its own MultiHeadAttention (Dense wq, wk, wv, dense), post-norm with eps 1e-6,
  interleaved sinusoids; read from a Keras .weights.h5.
- `tf-tutorial-v2`: the current TensorFlow tutorial ("Neural machine translation with a
  Transformer and Keras"): keras.layers.MultiHeadAttention with key_dim=d_model (heads d_model
  wide: key_dim), LayerNormalization's default eps 1e-3, concatenated sinusoids.
- `keras-prenorm`: the Keras pre-norm Transformer of seed text 004 (its `Transformer` of an
  `Encoder` and a `Decoder` of `ResidualNormalizationWrapper`s), as Keras 3's
  `model.save_weights("x.weights.h5")` names it: bias-free attention projections, its own
  LayerNormalization (eps 1e-6), output_normalization on each stack, pad embeddings masked to
  zero (imported as a zero pad row: the same function), an untied bias-free output Dense; pad
  keys masked in every attention, as the spec does. Keras 2's layouts are refused by name.

What each text fixes is `fixed` (with why); what its text uses but a user may change (dropout,
ids) is `defaults`; the heads, which no shape tells when the projections are [d, d], are `needs`.
docs/PORTING.md has each table, generated from these.
"""

from __future__ import annotations

from transformer_rosetta.porting.nn_transformer import nn_transformer_rules
from transformer_rosetta.porting.table import Buffer, Rule, Table

_QKVO = ("query", "key", "value", "output")


def _attention_rules(
    here: str, there: str, names: dict[str, str], leaf: dict[str, str], sep: str = "."
) -> list[Rule]:
    """The four projections of one attention, each a separate [out, in] Linear or [in, out]
    Dense: `names` maps query/key/value/output to the source module (joined to `there` by
    `sep`: '.' in a state_dict, '/' in an h5 file), `leaf` the kernel and bias names and whether
    the kernel is stored transposed."""
    kernel_steps = ("transpose", "heads") if leaf.get("transposed") else ("heads",)
    out = []
    for proj in _QKVO:
        module = f"{there}{sep}{names[proj]}"
        out.append(Rule(f"{here}.{proj}.kernel", f"{module}{leaf['kernel']}", kernel_steps))
        bias_steps = () if proj == "output" else ("heads",)
        out.append(Rule(f"{here}.{proj}.bias", f"{module}{leaf['bias']}", bias_steps))
    return out


def _norm_rules(here: str, there: str, scale: str, bias: str) -> list[Rule]:
    return [Rule(f"{here}.scale", f"{there}{scale}"), Rule(f"{here}.bias", f"{there}{bias}")]


def _dense_rules(here: str, there: str, leaf: dict[str, str]) -> list[Rule]:
    steps = ("transpose",) if leaf.get("transposed") else ()
    return [
        Rule(f"{here}.kernel", f"{there}{leaf['kernel']}", steps),
        Rule(f"{here}.bias", f"{there}{leaf['bias']}"),
    ]


# -- the Annotated Transformer ------------------------------------------------------------------

TORCH_LINEAR = {"kernel": ".weight", "bias": ".bias", "transposed": "yes"}
_ANNOTATED_LINEARS = {proj: f"linears.{n}" for n, proj in enumerate(_QKVO)}
# Sublayer n of a layer's `sublayer` ModuleList is the n-th residual: self-attention, (cross-
# attention,) feed-forward.
_ANNOTATED_SUBLAYERS = {
    "encoder": {"self_attention": "self_attn", "feed_forward": None},
    "decoder": {"self_attention": "self_attn", "cross_attention": "src_attn", "feed_forward": None},
}


def _annotated_rules() -> list[Rule]:
    out = [
        Rule("encoder.embedding", "src_embed.0.lut.weight"),
        Rule("decoder.embedding", "tgt_embed.0.lut.weight"),
        Rule("output.kernel", "generator.proj.weight", ("transpose",)),
        Rule("output.bias", "generator.proj.bias"),
    ]
    for stack, sublayers in _ANNOTATED_SUBLAYERS.items():
        layer, there = f"{stack}.layers.{{i}}", f"{stack}.layers.{{i}}"
        for n, (sublayer, module) in enumerate(sublayers.items()):
            norm = f"{there}.sublayer.{n}.norm"
            out += _norm_rules(f"{layer}.{sublayer}_norm", norm, ".a_2", ".b_2")
            if module is None:  # PositionwiseFeedForward: w_1, w_2
                ff = f"{there}.feed_forward"
                out += _dense_rules(f"{layer}.feed_forward.intermediate", f"{ff}.w_1", TORCH_LINEAR)
                out += _dense_rules(f"{layer}.feed_forward.output", f"{ff}.w_2", TORCH_LINEAR)
            else:
                out += _attention_rules(
                    f"{layer}.{sublayer}", f"{there}.{module}", _ANNOTATED_LINEARS, TORCH_LINEAR
                )
        out += _norm_rules(f"{stack}.final_norm", f"{stack}.norm", ".a_2", ".b_2")
    return out


ANNOTATED = Table(
    kind="annotated",
    model="the Annotated Transformer",
    rules=tuple(_annotated_rules()),
    fixed={
        "norm_position": "pre",
        "final_norm": True,
        "norm_kind": "std_plus_eps",
        "layer_norm_eps": 1e-6,
        "activation": "relu",
        "position_kind": "sinusoidal",
        "sinusoid_layout": "interleaved",
        "scale_embeddings": True,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": True,
        "attention_bias": True,
    },
    why={
        "norm_position": "the Annotated Transformer is pre-norm: x + dropout(sublayer(norm(x)))",
        "final_norm": "the Annotated Transformer's Encoder and Decoder each end with a LayerNorm",
        "norm_kind": "the Annotated Transformer's LayerNorm is a_2 * (x - mean) / (std + eps) + "
        "b_2 with the unbiased std: norm_kind 'std_plus_eps'",
        "layer_norm_eps": "the Annotated Transformer's LayerNorm adds eps = 1e-6 to the std",
        "share_embeddings": "the Annotated Transformer has separate src_embed and tgt_embed",
        "tie_output": "the Annotated Transformer's Generator is its own Linear",
        "output_bias": "the Annotated Transformer's Generator Linear has a bias",
    },
    # make_model's dropout, which its attention also applies to the probabilities. (Its
    # feed-forward drops out after the ReLU too, in training only: no field, see PORTING.md.)
    defaults={"dropout": 0.1, "attention_dropout": 0.1},
    needs=("num_heads",),
    sizes={
        "src_vocab_size": ("src_embed.0.lut.weight", 0),
        "d_model": ("src_embed.0.lut.weight", 1),
        "tgt_vocab_size": ("tgt_embed.0.lut.weight", 0),
        "d_ff": ("encoder.layers.0.feed_forward.w_1.weight", 0),
        "max_len": ("src_embed.1.pe", 1),
    },
    layer_counts={
        "num_encoder_layers": "encoder.layers.{i}.",
        "num_decoder_layers": "decoder.layers.{i}.",
    },
    # PositionalEncoding's persistent buffer `pe`, (1, max_len, d), computed in torch's default
    # dtype: div_term = exp(arange(0, d, 2) * -(ln 10000 / d)).
    buffers=(
        Buffer(
            "src_embed.1.pe",
            "interleaved",
            ("squeeze:0",),
            "stored",
            ("encoder.position_embedding",),
        ),
        Buffer(
            "tgt_embed.1.pe",
            "interleaved",
            ("squeeze:0",),
            "stored",
            ("decoder.position_embedding",),
        ),
    ),
)


# -- PyTorch's translation tutorial ---------------------------------------------------------------

PYTORCH_TUTORIAL = Table(
    kind="pytorch-tutorial",
    model="the PyTorch translation tutorial's Seq2SeqTransformer",
    rules=(
        Rule("encoder.embedding", "src_tok_emb.embedding.weight"),
        Rule("decoder.embedding", "tgt_tok_emb.embedding.weight"),
        Rule("output.kernel", "generator.weight", ("transpose",)),
        Rule("output.bias", "generator.bias"),
        *nn_transformer_rules("transformer."),
    ),
    fixed={
        "norm_position": "post",
        "final_norm": True,
        "norm_kind": "layer_norm",
        "layer_norm_eps": 1e-5,
        "activation": "relu",
        "position_kind": "sinusoidal",
        "sinusoid_layout": "interleaved",
        "scale_embeddings": True,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": True,
        "attention_bias": True,
    },
    why={
        "final_norm": "nn.Transformer always has a final encoder and decoder LayerNorm",
        "layer_norm_eps": "nn.Transformer's LayerNorms use torch's default eps, 1e-5",
        "norm_position": "the tutorial's nn.Transformer is post-norm (norm_first=False)",
    },
    # The tutorial's dropout and special symbols: UNK 0, PAD 1, BOS 2, EOS 3.
    defaults={"dropout": 0.1, "attention_dropout": 0.1, "pad_id": 1, "bos_id": 2, "eos_id": 3},
    needs=("num_heads",),
    sizes={
        "src_vocab_size": ("src_tok_emb.embedding.weight", 0),
        "d_model": ("src_tok_emb.embedding.weight", 1),
        "tgt_vocab_size": ("tgt_tok_emb.embedding.weight", 0),
        "d_ff": ("transformer.encoder.layers.0.linear1.weight", 0),
        "max_len": ("positional_encoding.pos_embedding", 0),
    },
    layer_counts={
        "num_encoder_layers": "transformer.encoder.layers.{i}.",
        "num_decoder_layers": "transformer.decoder.layers.{i}.",
    },
    # PositionalEncoding's buffer (maxlen, 1, emb), one table for both stacks, computed in
    # torch's default dtype.
    buffers=(
        Buffer(
            "positional_encoding.pos_embedding",
            "interleaved",
            ("squeeze:1",),
            "stored",
            ("encoder.position_embedding", "decoder.position_embedding"),
        ),
    ),
)


# -- TensorFlow's tutorials and the Keras pre-norm model (Keras .weights.h5) ---------------------

# A Keras Dense stores its kernel [in, out] (canonical already) as vars/0 and its bias as vars/1;
# a LayerNormalization its gamma and beta, in that order. keras.saving names the i-th layer of
# one class in a list "<class>{_i}" ("encoder_layer", "encoder_layer_1", ...): {_i}.
KERAS_DENSE = {"kernel": "/vars/0", "bias": "/vars/1"}
KERAS_NORM = ("/vars/0", "/vars/1")


def _keras_stack_rules(
    stack: str,
    there: str,
    attention: dict[str, tuple[str, str]],
    names: dict[str, str],
    ffn: tuple[str, str, str],
) -> list[Rule]:
    """One Keras stack's layers: `attention` maps each canonical attention to (the h5 group of
    its projections, of its norm), `names` the projections' layer names, `ffn` is (the first
    Dense, the second Dense, the feed-forward norm)."""
    layer = f"{stack}.layers.{{i}}"
    out = []
    for sublayer, (module, norm) in attention.items():
        out += _attention_rules(f"{layer}.{sublayer}", f"{there}/{module}", names, KERAS_DENSE, "/")
        out += _norm_rules(f"{layer}.{sublayer}_norm", f"{there}/{norm}", *KERAS_NORM)
    first, second, norm = ffn
    out += _dense_rules(f"{layer}.feed_forward.intermediate", f"{there}/{first}", KERAS_DENSE)
    out += _dense_rules(f"{layer}.feed_forward.output", f"{there}/{second}", KERAS_DENSE)
    out += _norm_rules(f"{layer}.feed_forward_norm", f"{there}/{norm}", *KERAS_NORM)
    return out


def _untied_embedding_rules(source: str, target: str, output: str) -> list[Rule]:
    return [
        Rule("encoder.embedding", source),
        Rule("decoder.embedding", target),
        Rule("output.kernel", f"{output}/vars/0"),
        Rule("output.bias", f"{output}/vars/1"),
    ]


# Post-norm, no final norm, separate embeddings times sqrt(d_model), a Dense output with a bias,
# biases on every attention projection: what both TensorFlow tutorials fix.
_TF_TUTORIAL_FIXED = {
    "norm_position": "post",
    "final_norm": False,
    "norm_kind": "layer_norm",
    "activation": "relu",
    "position_kind": "sinusoidal",
    "scale_embeddings": True,
    "share_embeddings": False,
    "tie_output": False,
    "output_bias": True,
    "attention_bias": True,
    "pad_id": 0,
}
_TF_TUTORIAL_WHY = {
    "norm_position": "the TensorFlow tutorial is post-norm: LayerNorm(x + sublayer(x))",
    "final_norm": "the TensorFlow tutorial's Encoder and Decoder end without a LayerNorm",
    "pad_id": "the TensorFlow tutorial masks token 0 as padding",
}


def _v1_rules() -> list[Rule]:
    out = _untied_embedding_rules(
        "encoder/embedding/vars/0", "decoder/embedding/vars/0", "final_layer"
    )
    names = {"query": "wq", "key": "wk", "value": "wv", "output": "dense"}
    ffn = ("ffn/layers/dense", "ffn/layers/dense_1")
    out += _keras_stack_rules(
        "encoder",
        "encoder/enc_layers/encoder_layer{_i}",
        {"self_attention": ("mha", "layernorm1")},
        names,
        (*ffn, "layernorm2"),
    )
    out += _keras_stack_rules(
        "decoder",
        "decoder/dec_layers/decoder_layer{_i}",
        {"self_attention": ("mha1", "layernorm1"), "cross_attention": ("mha2", "layernorm2")},
        names,
        (*ffn, "layernorm3"),
    )
    return out


TF_TUTORIAL_V1 = Table(
    kind="tf-tutorial-v1",
    model="the older TensorFlow Transformer tutorial",
    rules=tuple(_v1_rules()),
    fixed={**_TF_TUTORIAL_FIXED, "layer_norm_eps": 1e-6, "sinusoid_layout": "interleaved"},
    why={
        **_TF_TUTORIAL_WHY,
        "layer_norm_eps": "the older tutorial's LayerNormalization(epsilon=1e-6)",
        "sinusoid_layout": "the older tutorial's positional_encoding puts sin at even and cos at "
        "odd columns",
    },
    # Its dropout (none on the attention probabilities) and pe_input = pe_target = 1000. Its
    # start and end tokens are the tokenizer's vocab_size and vocab_size + 1: --config says.
    defaults={"dropout": 0.1, "attention_dropout": 0.0, "max_len": 1000},
    needs=("num_heads", "bos_id", "eos_id"),
    sizes={
        "src_vocab_size": ("encoder/embedding/vars/0", 0),
        "d_model": ("encoder/embedding/vars/0", 1),
        "tgt_vocab_size": ("decoder/embedding/vars/0", 0),
        "d_ff": ("encoder/enc_layers/encoder_layer/ffn/layers/dense/vars/0", 1),
    },
    layer_counts={
        "num_encoder_layers": "encoder/enc_layers/encoder_layer{_i}/",
        "num_decoder_layers": "decoder/dec_layers/decoder_layer{_i}/",
    },
)


def _v2_rules() -> list[Rule]:
    out = _untied_embedding_rules(
        "encoder/pos_embedding/embedding/vars/0",
        "decoder/pos_embedding/embedding/vars/0",
        "final_layer",
    )
    names = {p: f"{p}_dense" for p in _QKVO}
    ffn = ("ffn/seq/layers/dense", "ffn/seq/layers/dense_1", "ffn/layer_norm")
    out += _keras_stack_rules(
        "encoder",
        "encoder/enc_layers/encoder_layer{_i}",
        {"self_attention": ("self_attention/mha", "self_attention/layernorm")},
        names,
        ffn,
    )
    out += _keras_stack_rules(
        "decoder",
        "decoder/dec_layers/decoder_layer{_i}",
        {
            "self_attention": ("causal_self_attention/mha", "causal_self_attention/layernorm"),
            "cross_attention": ("cross_attention/mha", "cross_attention/layernorm"),
        },
        names,
        ffn,
    )
    # keras.layers.MultiHeadAttention keeps heads as an axis already: [d, h, key_dim].
    return [Rule(r.canonical, r.source, tuple(s for s in r.steps if s != "heads")) for r in out]


_V2_QUERY = "encoder/enc_layers/encoder_layer/self_attention/mha/query_dense/vars/0"
TF_TUTORIAL_V2 = Table(
    kind="tf-tutorial-v2",
    model="the current TensorFlow Transformer tutorial",
    rules=tuple(_v2_rules()),
    fixed={**_TF_TUTORIAL_FIXED, "layer_norm_eps": 1e-3, "sinusoid_layout": "concatenated"},
    why={
        **_TF_TUTORIAL_WHY,
        "layer_norm_eps": "the current tutorial's LayerNormalization() keeps Keras's default "
        "epsilon, 1e-3",
        "sinusoid_layout": "the current tutorial's positional_encoding puts every sin first, then "
        "every cos",
    },
    # MultiHeadAttention(dropout=dropout_rate) drops attention probabilities; positions are
    # computed for length 2048; [PAD] 0, [UNK] 1, [START] 2, [END] 3.
    defaults={"dropout": 0.1, "attention_dropout": 0.1, "max_len": 2048, "bos_id": 2, "eos_id": 3},
    sizes={
        "src_vocab_size": ("encoder/pos_embedding/embedding/vars/0", 0),
        "d_model": ("encoder/pos_embedding/embedding/vars/0", 1),
        "tgt_vocab_size": ("decoder/pos_embedding/embedding/vars/0", 0),
        "d_ff": ("encoder/enc_layers/encoder_layer/ffn/seq/layers/dense/vars/0", 1),
        # key_dim=d_model: each head is d_model wide, read from the kernel [d, h, key_dim].
        "num_heads": (_V2_QUERY, 1),
        "key_dim": (_V2_QUERY, 2),
    },
    layer_counts={
        "num_encoder_layers": "encoder/enc_layers/encoder_layer{_i}/",
        "num_decoder_layers": "decoder/dec_layers/decoder_layer{_i}/",
    },
)


# The Keras pre-norm model of seed text 004, as its Transformer's `model.save_weights("x.weights.h5")`
# names it in Keras 3. keras.saving walks each object's attributes in sorted order, then a Model's
# `layers` property: a layer reached first through `layers` is stored as "layers/<class>{_n}",
# numbered per class in creation order (a layer already stored still takes its number). So in
# each Encoder and Decoder, `attention_block_list` (a list of per-hop lists, "container{_i}")
# comes first, then `layers` claims `token_embedding`, `output_normalization`
# ("layer_normalization") and the Decoder's unnamed output Dense ("dense"). In an attention,
# `k_dense_layer` sorts before `layers` and keeps its name; q, v and output are the 1st, 3rd and
# 4th Dense it creates: "layers/dense", "layers/dense_2", "layers/dense_3". In a
# FeedForwardNetwork, `filter_dense_layer` keeps its name and its output Dense is
# "layers/dense_1".
_PRENORM_QKVO = {
    "query": "layer/layers/dense",
    "key": "layer/k_dense_layer",
    "value": "layer/layers/dense_2",
    "output": "layer/layers/dense_3",
}
_PRENORM_WRAPPER = "residual_normalization_wrapper"


def _prenorm_rules() -> list[Rule]:
    """Each hop is a list of ResidualNormalizationWrappers (self-attention, (cross-attention,)
    feed-forward), each with its wrapped `layer` and its `layer_normalization`."""
    out = [
        # TokenEmbedding multiplies its output by (id != PAD_ID): a zero pad row computes the same.
        Rule("encoder.embedding", "encoder/layers/token_embedding/vars/0", ("zero_pad_row",)),
        Rule("decoder.embedding", "decoder/layers/token_embedding/vars/0", ("zero_pad_row",)),
        Rule("output.kernel", "decoder/layers/dense/vars/0"),
    ]
    for stack, attentions in (
        ("encoder", ("self_attention",)),
        ("decoder", ("self_attention", "cross_attention")),
    ):
        layer, there = f"{stack}.layers.{{i}}", f"{stack}/attention_block_list/container{{_i}}"
        for n, sublayer in enumerate((*attentions, "feed_forward")):
            w = f"{there}/{_PRENORM_WRAPPER}{'' if n == 0 else f'_{n}'}"
            out += _norm_rules(f"{layer}.{sublayer}_norm", f"{w}/layer_normalization", *KERAS_NORM)
            if sublayer == "feed_forward":
                ff = f"{layer}.feed_forward"
                out += _dense_rules(
                    f"{ff}.intermediate", f"{w}/layer/filter_dense_layer", KERAS_DENSE
                )
                out += _dense_rules(f"{ff}.output", f"{w}/layer/layers/dense_1", KERAS_DENSE)
                continue
            for proj in _QKVO:  # no biases: only kernels, [d, d] -> [d, h, d_k]
                source = f"{w}/{_PRENORM_QKVO[proj]}/vars/0"
                out.append(Rule(f"{layer}.{sublayer}.{proj}.kernel", source, ("heads",)))
        out += _norm_rules(
            f"{stack}.final_norm", f"{stack}/layers/layer_normalization", *KERAS_NORM
        )
    return out


_PRENORM_EMBEDDING = "encoder/layers/token_embedding/vars/0"
_PRENORM_FFN = (
    f"encoder/attention_block_list/container/{_PRENORM_WRAPPER}_1/layer/filter_dense_layer"
)
_PRENORM_READS = (
    "--from keras-prenorm reads what Keras 3's model.save_weights('x.weights.h5') writes for the "
    "text's Transformer (encoder/layers/token_embedding/vars/0, ...)"
)
KERAS_PRENORM = Table(
    kind="keras-prenorm",
    model="the Keras pre-norm Transformer of seed text 004",
    rules=tuple(_prenorm_rules()),
    fixed={
        "norm_position": "pre",
        "final_norm": True,
        "norm_kind": "layer_norm",
        "layer_norm_eps": 1e-6,
        "activation": "relu",
        "position_kind": "sinusoidal",
        "sinusoid_layout": "interleaved",
        "scale_embeddings": True,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": False,
        "attention_bias": False,
        "pad_id": 0,
    },
    why={
        "norm_position": "the Keras pre-norm model's ResidualNormalizationWrapper computes "
        "input + dropout(layer(LayerNormalization(input)))",
        "final_norm": "the Keras pre-norm model ends each stack with output_normalization",
        "layer_norm_eps": "the Keras pre-norm model's LayerNormalization uses epsilon 1e-6",
        "attention_bias": "the Keras pre-norm model's q/k/v/output Dense layers have no bias",
        "output_bias": "the Keras pre-norm model's output Dense has no bias",
        "pad_id": "the Keras pre-norm model masks PAD_ID 0 (pad keys, and the pad embedding)",
        "sinusoid_layout": "its AddPositionalEncoding computes sin(pos / 10000^(2 floor(i/2) / d) "
        "+ (i mod 2) pi/2): interleaved",
    },
    # The text's dropout_rate 0.1 (also on the attention weights) and max_length 200 (unused by
    # its positions, which any length computes). The text never names its BOS and EOS: 1 and 2
    # are those of the code it follows (a tokenizer with pad 0, BOS 1, EOS 2, unk 3).
    defaults={"dropout": 0.1, "attention_dropout": 0.1, "max_len": 200, "bos_id": 1, "eos_id": 2},
    needs=("num_heads",),
    sizes={
        "src_vocab_size": (_PRENORM_EMBEDDING, 0),
        "d_model": (_PRENORM_EMBEDDING, 1),
        "tgt_vocab_size": ("decoder/layers/token_embedding/vars/0", 0),
        "d_ff": (f"{_PRENORM_FFN}/vars/0", 1),
    },
    layer_counts={
        "num_encoder_layers": "encoder/attention_block_list/container{_i}/",
        "num_decoder_layers": "decoder/attention_block_list/container{_i}/",
    },
    hints={
        # The names of this importer's earlier fixture (written from a description in the style
        # of TensorFlow's official TF1 model, not from the text): never written by the text.
        "encoder_embedding_layer/vars/0": "encoder_embedding_layer/vars/0: the names of a model "
        "in the style of TensorFlow's official TF1 Transformer (encoder_stack/..., "
        f"PrePostProcessingWrapper), which seed text 004's code does not write; {_PRENORM_READS}",
        # Keras 2 (tf_keras) writes its .weights.h5 under layers/, the wrappers numbered across
        # hops (2i and 2i + 1 in the encoder, 3i to 3i + 2 in the decoder); Keras 3's
        # load_weights skips those lists (a warning) and keeps the fresh weights.
        "layers/encoder/token_embedding/vars/0": "layers/encoder/token_embedding/vars/0: a Keras 2 "
        "(tf_keras) .weights.h5, which numbers the wrappers across hops and which Keras 3 loads "
        f"only in part; {_PRENORM_READS}: from Keras 2 save a legacy .h5 "
        "(model.save_weights('x.h5')), load that into the model under Keras 3 and save it so",
        # Keras 2's legacy HDF5 layout (tf.keras model.save_weights("x.h5")): each weight under
        # its TensorFlow variable name, "encoder/transformer/encoder/hopping_0/.../kernel:0",
        # with automatic numbers ("layer_normalization_13") that depend on the session. Keras 3's
        # load_weights reads it into the text's model whole (checked on the logits).
        "*:0": "a legacy Keras 2 / tf.keras .h5 (model.save_weights('x.h5'): TensorFlow variable "
        f"names such as .../token_embedding/token_embedding:0); {_PRENORM_READS}: load it into "
        "the model under Keras 3 (model.load_weights) and save it so",
    },
)

TABLES: dict[str, Table] = {
    t.kind: t for t in (ANNOTATED, PYTORCH_TUTORIAL, TF_TUTORIAL_V1, TF_TUTORIAL_V2, KERAS_PRENORM)
}
