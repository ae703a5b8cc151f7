"""Properties of the NumPy oracle that follow from the paper, checked against hand-computed
numbers and literal (loop-over-heads) restatements of its equations."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.masks import (
    causal_mask,
    decoder_self_mask,
    key_padding_mask,
    shift_right,
)
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny").replace(num_heads=4, d_model=16, d_ff=24)


@pytest.fixture(scope="module")
def run():
    weights = init_weights(CONFIG, seed=5, scheme="perturbed", dtype="float64")
    src, tgt_in = ragged_batch(CONFIG, batch=4, src_len=6, tgt_len=5, seed=3)
    return weights, src, tgt_in, reference.forward(weights, CONFIG, src, tgt_in, hidden_states=True)


def test_shapes(run):
    _, src, tgt_in, out = run
    b, s, t = src.shape[0], src.shape[1], tgt_in.shape[1]
    assert out.logits.shape == (b, t, CONFIG.tgt_vocab_size)
    assert out.encoder_output.shape == (b, s, CONFIG.d_model)
    assert [a.shape for a in out.encoder_self_attention] == [(b, 4, s, s)] * 2
    assert [a.shape for a in out.decoder_self_attention] == [(b, 4, t, t)] * 2
    assert [a.shape for a in out.cross_attention] == [(b, 4, t, s)] * 2
    assert len(out.encoder_hidden_states) == CONFIG.num_encoder_layers + 1


def test_attention_rows_sum_to_one_over_allowed_keys_and_are_zero_elsewhere(run):
    _, src, tgt_in, out = run
    cases = [
        (out.encoder_self_attention, key_padding_mask(src, 0)),
        (out.decoder_self_attention, decoder_self_mask(tgt_in, 0)),
        (out.cross_attention, key_padding_mask(src, 0)),
    ]
    for maps, mask in cases:
        for probs in maps:
            mask_b = np.broadcast_to(mask, probs.shape)
            assert np.all(probs[~mask_b] == 0.0)
            has_key = mask_b.any(axis=-1)
            sums = probs.sum(axis=-1)
            np.testing.assert_allclose(sums[has_key], 1.0, rtol=0, atol=1e-14)
            assert np.all(probs[mask_b] > 0)


def test_row_with_no_allowed_key_is_exactly_zero(run):
    _, src, _, out = run
    assert np.all(src[-1] == 0), "the last source row is all padding"
    for probs in out.encoder_self_attention + out.cross_attention:
        assert np.all(probs[-1] == 0.0)
        assert np.all(np.isfinite(probs))
    assert np.all(np.isfinite(out.logits))


def test_scaled_dot_product_attention_with_hand_computed_numbers():
    # One query, two keys: scores (q.k / sqrt(2)) = (1/sqrt2, 0) -> softmax (e^a, 1) / (e^a + 1).
    q = np.array([[[[1.0, 0.0]]]])
    k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = np.array([[[[10.0, 0.0], [0.0, 10.0]]]])
    context, probs = reference.scaled_dot_product_attention(q, k, v, np.ones((1, 1, 1, 2), bool))
    a = np.exp(1 / np.sqrt(2))
    np.testing.assert_allclose(probs[0, 0, 0], [a / (a + 1), 1 / (a + 1)], rtol=1e-15)
    np.testing.assert_allclose(context[0, 0, 0], [10 * a / (a + 1), 10 / (a + 1)], rtol=1e-15)
    # Masking the second key puts all weight on the first; masking both gives zeros, not NaN.
    _, probs = reference.scaled_dot_product_attention(q, k, v, np.array([[[[True, False]]]]))
    assert probs[0, 0, 0].tolist() == [1.0, 0.0]
    context, probs = reference.scaled_dot_product_attention(q, k, v, np.zeros((1, 1, 1, 2), bool))
    assert probs.tolist() == [[[[0.0, 0.0]]]] and context.tolist() == [[[[0.0, 0.0]]]]


def test_multi_head_attention_equals_eq4_written_with_a_loop_over_heads():
    """Eq. (4) literally: Concat(head_1..head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i),
    with W^O as one [h*d_k, d_model] matrix."""
    w = init_weights(CONFIG, seed=1, scheme="perturbed", dtype="float64")
    p = "decoder.layers.0.cross_attention"
    rng = np.random.default_rng(0)
    x_q, x_kv = rng.normal(size=(2, 3, 16)), rng.normal(size=(2, 5, 16))
    mask = np.ones((2, 1, 1, 5), bool)
    mask[1, ..., 3:] = False
    got, _ = reference.multi_head_attention(w, p, x_q, x_kv, mask, CONFIG)

    heads = []
    for i in range(CONFIG.num_heads):
        q = x_q @ w[f"{p}.query.kernel"][:, i] + w[f"{p}.query.bias"][i]
        k = x_kv @ w[f"{p}.key.kernel"][:, i] + w[f"{p}.key.bias"][i]
        v = x_kv @ w[f"{p}.value.kernel"][:, i] + w[f"{p}.value.bias"][i]
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(CONFIG.head_dim)
        scores[1, :, 3:] = -np.inf  # fine here: no row is fully masked
        e = np.exp(scores - scores.max(-1, keepdims=True))
        heads.append((e / e.sum(-1, keepdims=True)) @ v)
    w_o = w[f"{p}.output.kernel"].reshape(CONFIG.d_model, CONFIG.d_model)
    want = np.concatenate(heads, axis=-1) @ w_o + w[f"{p}.output.bias"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)


def test_causal_structure(run):
    weights, src, tgt_in, out = run
    for probs in out.decoder_self_attention:
        assert np.all(np.triu(np.ones((5, 5), bool), k=1)[None, None] <= (probs == 0))
    # Changing a later decoder input never changes an earlier position's logits.
    changed = tgt_in.copy()
    changed[0, 3] = (changed[0, 3] + 1) % CONFIG.tgt_vocab_size or 3
    again = reference.forward(weights, CONFIG, src, changed)
    np.testing.assert_array_equal(again.logits[0, :3], out.logits[0, :3])
    assert np.max(np.abs(again.logits[0, 3:] - out.logits[0, 3:])) > 1e-3


def test_causal_mask_and_shift_right():
    assert causal_mask(3)[0, 0].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert shift_right(np.array([[7, 8, 9, 2]]), bos_id=1).tolist() == [[1, 7, 8, 9]]
    # Position 0 stays visible even when BOS is the pad id (Marian).
    assert decoder_self_mask(np.array([[0, 5, 0]]), pad_id=0)[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, False],
    ]


def test_layer_norm_normalises_before_scale_and_bias():
    x = np.random.default_rng(0).normal(3.0, 5.0, size=(4, 7, 32))
    y = reference.layer_norm(x, np.ones(32), np.zeros(32), eps=1e-12)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-14)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-10)
    scaled = reference.layer_norm(x, np.full(32, 2.0), np.full(32, 0.5), eps=1e-12)
    np.testing.assert_allclose(scaled, 2.0 * y + 0.5, atol=1e-13)
    # eps sits inside the square root: a constant row gives exactly 0, and x / sqrt(var + eps).
    z = reference.layer_norm(np.array([[1.0, 3.0]]), np.ones(2), np.zeros(2), eps=1.0)
    np.testing.assert_allclose(z, [[-1 / np.sqrt(2), 1 / np.sqrt(2)]], rtol=1e-15)


def test_activations_at_hand_computed_points():
    x = np.array([-1.0, 0.0, 1.0, 2.0])
    assert reference.activation("relu", x).tolist() == [0.0, 0.0, 1.0, 2.0]
    # GELU(1) = Phi(1) = 0.841344746..., GELU(-1) = -(1 - Phi(1)).
    np.testing.assert_allclose(
        reference.activation("gelu", x),
        [-0.15865525393, 0.0, 0.84134474607, 1.95449973610],
        rtol=1e-10,
    )
    np.testing.assert_allclose(
        reference.activation("gelu_tanh", x),
        [-0.15880800939, 0.0, 0.84119199061, 1.95459769409],
        rtol=1e-10,
    )


def test_sinusoid_matches_the_formula_at_hand_computed_positions():
    pe = reference.sinusoidal_positions(3, 4, "interleaved")
    # d_model = 4: frequencies 1 and 1/100. PE(pos, 2i) = sin(pos / 10000^(2i/4)).
    assert pe[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    np.testing.assert_allclose(
        pe[1], [0.8414709848, 0.5403023059, 0.0099998333342, 0.9999500004167], rtol=1e-9
    )
    np.testing.assert_allclose(
        pe[2], [0.9092974268, -0.4161468365, 0.0199986666933, 0.9998000066666], rtol=1e-9
    )
    concat = reference.sinusoidal_positions(3, 4, "concatenated")
    np.testing.assert_allclose(
        concat[2], [0.9092974268, 0.0199986666933, -0.4161468365, 0.9998000066666], rtol=1e-9
    )


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_offset_is_a_fixed_rotation_section_3_5(layout):
    """Section 3.5: "for any fixed offset k, PE_{pos+k} can be represented as a linear function of
    PE_pos". The map is a rotation by angle k * w_i in each (sin, cos) pair, the same for every pos."""
    d, length = 16, 60
    pe = reference.sinusoidal_positions(length, d, layout)
    freqs = 1.0 / np.power(10000.0, np.arange(0, d, 2) / d)
    half = d // 2
    sin_idx = np.arange(0, d, 2) if layout == "interleaved" else np.arange(half)
    cos_idx = sin_idx + 1 if layout == "interleaved" else np.arange(half, d)
    for k in (1, 5, 17):
        rotation = np.zeros((d, d))
        c, s = np.cos(k * freqs), np.sin(k * freqs)
        # sin(w(p+k)) = sin(wp) cos(wk) + cos(wp) sin(wk); cos(w(p+k)) = cos(wp) cos(wk) - sin(wp) sin(wk)
        rotation[sin_idx, sin_idx], rotation[sin_idx, cos_idx] = c, s
        rotation[cos_idx, cos_idx], rotation[cos_idx, sin_idx] = c, -s
        np.testing.assert_allclose(pe[:-k] @ rotation.T, pe[k:], rtol=0, atol=1e-12)
        assert np.allclose(rotation @ rotation.T, np.eye(d))  # a rotation: orthogonal


def test_embedding_scale_and_tied_output():
    c = TransformerConfig(
        src_vocab_size=11,
        tgt_vocab_size=11,
        d_model=8,
        num_heads=2,
        d_ff=8,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_len=8,
    )
    w = init_weights(c, seed=2, scheme="perturbed", dtype="float64")
    ids = np.array([[3, 4]])
    x = reference.embed(w, "encoder", "shared_embedding", ids, c)
    want = w["shared_embedding"][ids] * np.sqrt(8) + reference.sinusoidal_positions(2, 8)[None]
    np.testing.assert_allclose(x, want, rtol=0, atol=0)
    y = np.random.default_rng(0).normal(size=(1, 2, 8))
    np.testing.assert_allclose(
        reference.output_logits(w, c, y), y @ w["shared_embedding"].T, rtol=0, atol=0
    )


def test_paper_init_is_deterministic_and_per_tensor():
    a = init_weights(CONFIG, seed=3)
    b = init_weights(CONFIG, seed=3)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    other = init_weights(CONFIG.replace(output_bias=True), seed=3)
    assert all(a[k].tobytes() == other[k].tobytes() for k in a)  # adding a tensor changes no other
    kernel = a["encoder.layers.0.feed_forward.intermediate.kernel"]  # xavier: U(+-sqrt(6/(16+24)))
    assert np.abs(kernel).max() <= np.sqrt(6 / 40) and np.abs(kernel).max() > 0.9 * np.sqrt(6 / 40)
    assert np.all(a["encoder.layers.0.self_attention.query.bias"] == 0)
    assert np.all(a["encoder.layers.0.self_attention_norm.scale"] == 1)
    emb = a["shared_embedding"]
    assert abs(emb.std() - CONFIG.d_model**-0.5) < 0.02


# -- today's decoders: RMSNorm, SiLU and the gated feed-forward, rotary positions, GQA -----------

LLAMA = preset("tiny_llama")


def test_rms_norm_at_hand_computed_points():
    """x / sqrt(mean(x^2) + eps) * scale: [3, 4] has mean square 12.5; no mean is subtracted and
    no bias is added (a LayerNorm of [3, 4] would be [-1, 1])."""
    y = reference.layer_norm(np.array([[3.0, 4.0]]), np.array([1.0, 2.0]), None, 0.0, "rms_norm")
    np.testing.assert_allclose(y, [[3 / np.sqrt(12.5), 2 * 4 / np.sqrt(12.5)]], rtol=1e-15)
    z = reference.layer_norm(np.array([[0.0, 0.0]]), np.ones(2), None, 0.25, "rms_norm")
    assert z.tolist() == [[0.0, 0.0]]  # eps inside the root: no division by zero


def test_silu_and_the_gated_feed_forward_at_hand_computed_points():
    """silu(1) = 1 / (1 + e^-1); SwiGLU (act(x W_gate) * x W_1) W_2 on one-hot kernels."""
    assert reference.activation("silu", np.array(1.0)) == pytest.approx(0.7310585786300049, 1e-15)
    assert reference.activation("silu", np.array(-1.0)) == pytest.approx(-0.2689414213699951, 1e-15)
    c = LLAMA.replace(d_model=2, num_heads=1, num_kv_heads=None, d_ff=2)
    w = {
        "f.gate.kernel": np.array([[1.0, 0.0], [0.0, 0.0]]),
        "f.intermediate.kernel": np.array([[0.0, 0.0], [0.0, 3.0]]),
        "f.output.kernel": np.array([[1.0, 1.0], [1.0, 1.0]]),
    }
    y = reference.feed_forward(w, "f", np.array([[[1.0, 2.0]]]), c)
    # gate: [silu(1), silu(0)] = [0.731, 0]; up: [0, 6]; product [0, 0]: the gate closes it.
    assert y.tolist() == [[[0.0, 0.0]]]
    w["f.gate.kernel"] = np.array([[0.0, 1.0], [0.0, 0.0]])  # gate [0, silu(1)]
    y = reference.feed_forward(w, "f", np.array([[[1.0, 2.0]]]), c)
    np.testing.assert_allclose(y, [[[6 * 0.7310585786300049] * 2]], rtol=1e-15)


def test_rotary_angles_at_hand_computed_points():
    """angle(pos, i) = pos * theta^(-2i / d_k): d_k 4, theta 100 gives frequencies 1 and 0.1."""
    np.testing.assert_allclose(
        reference.rotary_angles(3, 4, 100.0), [[0, 0], [1, 0.1], [2, 0.2]], rtol=1e-15
    )


@pytest.mark.parametrize("layout", ["half_split", "interleaved"])
def test_rotation_of_one_pair_by_hand(layout):
    """A pair (a, b) turns into (a cos - b sin, b cos + a sin): [1, 0] by 90 degrees is [0, 1].
    The half-split pair of dimension 0 is dimension d_k/2; the interleaved one is dimension 1."""
    x = np.zeros((1, 4))
    x[0, 0] = 1.0
    angle = np.array([[np.pi / 2, 0.0]])
    y = reference.rotate(x, angle, layout)
    partner = 2 if layout == "half_split" else 1
    expected = np.zeros((1, 4))
    expected[0, partner] = 1.0
    np.testing.assert_allclose(y, expected, atol=1e-16)


def test_the_two_rotary_layouts_are_one_permutation_apart():
    """Interleaved pairs (2i, 2i+1) and half-split pairs (i, i + d/2) rotate the same pairs
    once the dimensions are permuted: rotate_interleaved(x) = P^-1 rotate_half(P x), with P the
    permutation that Hugging Face's convert_llama_weights_to_hf applies to q and k."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8))
    angle = reference.rotary_angles(5, 8, 10000.0)
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])  # [0, 2, 4, 6, 1, 3, 5, 7]
    half = reference.rotate(x[..., perm], angle, "half_split")
    inter = reference.rotate(x, angle, "interleaved")
    np.testing.assert_allclose(half, inter[..., perm], atol=1e-15)
    assert np.abs(reference.rotate(x, angle, "half_split") - inter).max() > 0.1


def test_rotary_scores_depend_only_on_the_offset():
    """RoFormer's point (Su et al. 2021, section 3.2): q_m . k_n after rotation is a function of
    m - n. Shifting both positions by 3 leaves the score as it was."""
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=8), rng.normal(size=8)
    angle = reference.rotary_angles(10, 8, 10000.0)
    for layout in ("half_split", "interleaved"):

        def score(m, n, layout=layout):
            qm = reference.rotate(q[None], angle[m : m + 1], layout)[0]
            kn = reference.rotate(k[None], angle[n : n + 1], layout)[0]
            return qm @ kn

        assert score(5, 2) == pytest.approx(score(8, 5), abs=1e-14)
        assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_grouped_query_attention_is_multi_head_with_repeated_keys_and_values():
    """A model with num_kv_heads 2 of 4 equals, to rounding, the multi-head model whose key and
    value kernels repeat each key/value head for its two query heads (repeat_kv)."""
    gqa = LLAMA.replace(attention_bias=True)
    mha = gqa.replace(num_kv_heads=None)
    w = init_weights(gqa, seed=3, scheme="perturbed", dtype="float64")
    repeated = dict(w)
    for name, t in w.items():
        if ".key." in name or ".value." in name:
            axis = 1 if name.endswith("kernel") else 0
            repeated[name] = np.repeat(t, 2, axis=axis)
    _, tgt = ragged_batch(gqa, batch=3, src_len=1, tgt_len=6, seed=2)
    got = reference.forward(w, gqa, None, tgt)
    want = reference.forward(repeated, mha, None, tgt)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-14)
    np.testing.assert_allclose(
        got.decoder_self_attention[0], want.decoder_self_attention[0], rtol=0, atol=1e-15
    )
    shrunk = {k: v for k, v in w.items() if ".key." in k}
    assert shrunk["decoder.layers.0.self_attention.key.kernel"].shape == (32, 2, 8)


def test_a_rotary_model_sees_order_without_a_position_table():
    """No tensor holds positions, yet swapping two tokens changes the logits after them; without
    rotation, the last position of one layer attends its prefix as a set and could not tell."""
    one_layer = LLAMA.replace(num_decoder_layers=1)
    w = init_weights(one_layer, seed=4, scheme="perturbed", dtype="float64")
    assert not any("position" in name for name in w)
    a = np.array([[5, 6, 7, 8]])
    b = np.array([[6, 5, 7, 8]])
    la = reference.forward(w, one_layer, None, a).logits[0, -1]
    lb = reference.forward(w, one_layer, None, b).logits[0, -1]
    assert np.abs(la - lb).max() > 1e-3
    no_rotary = one_layer.replace(position_kind="learned")
    w2 = {**w, "decoder.position_embedding": np.zeros((LLAMA.max_len, LLAMA.d_model))}
    la = reference.forward(w2, no_rotary, None, a).logits[0, -1]
    lb = reference.forward(w2, no_rotary, None, b).logits[0, -1]
    assert np.abs(la - lb).max() < 1e-13
