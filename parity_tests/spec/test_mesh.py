"""The device mesh as the command line names it: parsing, the checks made before anything starts,
the rows each data replica takes, and the loss weight that makes replicas compute the one-device
loss on a ragged batch (the trap: a mean of per-replica means is not the global mean)."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle.training import label_smoothed_loss
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.mesh import (
    MeshShape,
    check_mesh,
    mesh_problems,
    parse_mesh,
    replica_loss_scale,
    replica_rows,
    target_tokens,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("data=2", MeshShape(2, 1)),
        ("model=4", MeshShape(1, 4)),
        ("data=2,model=2", MeshShape(2, 2)),
        (" model = 2 , data = 3 ", MeshShape(3, 2)),
    ],
)
def test_a_mesh_parses_by_axis_name(text, want):
    mesh = parse_mesh(text)
    assert mesh == want
    assert parse_mesh(str(mesh)) == mesh  # str is the form the CLI prints, and reads back
    assert mesh.size == want.data * want.model


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("data=0", "at least 1"),
        ("pipeline=2", "unknown axis 'pipeline'"),
        ("data=2,data=4", "given twice"),
        ("data", "AXIS=N"),
        ("data=-1", "AXIS=N"),
        ("", "AXIS=N"),
    ],
)
def test_a_bad_mesh_is_one_line_naming_the_problem(text, named):
    with pytest.raises(InputError) as info:
        parse_mesh(text)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_every_reason_a_mesh_cannot_run_is_named_before_anything_starts():
    c = preset("tiny")  # 2 heads, d_ff 32
    assert mesh_problems(MeshShape(2, 2), c, batch=4, devices=4) == []
    problems = mesh_problems(MeshShape(3, 4), c.replace(d_ff=30), batch=4, devices=2)
    assert problems == [
        "the batch of 4 rows does not divide over data=3 replicas",
        "num_heads=2 does not divide over model=4 shards",
        "d_ff=30 does not divide over model=4 shards",
        "the mesh data=3,model=4 needs 12 devices, and 2 are available",
    ]
    with pytest.raises(InputError, match=r"^--mesh data=1,model=2: .*1 is available$"):
        check_mesh(MeshShape(1, 2), c, devices=1)


def test_replicas_take_contiguous_blocks_that_cover_the_batch_once():
    rows = [replica_rows(6, 3, r) for r in range(3)]
    assert rows == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(InputError):
        replica_rows(5, 2, 0)


def test_the_global_token_count_fixes_the_ragged_trap():
    """Two replicas of a ragged batch: the one-device loss is sum(S) / T. Each replica's own mean,
    averaged (what DDP / pmean do to per-replica means), is not; scaling each replica's token sum
    by replica_loss_scale gives it back under both kinds of reduction."""
    rng = np.random.default_rng(0)
    c = preset("tiny")
    logits = rng.normal(size=(4, 5, c.tgt_vocab_size))
    tgt = rng.integers(3, c.tgt_vocab_size, size=(4, 5))
    tgt[2:, 1:] = c.pad_id  # replica 1 holds 2 tokens, replica 0 holds 10
    whole, _, tokens = label_smoothed_loss(logits, tgt, c.pad_id, 0.1)
    assert tokens == target_tokens(tgt, c.pad_id) == 12
    means, sums = [], []
    for r in range(2):
        rows = replica_rows(4, 2, r)
        mean, _, n = label_smoothed_loss(logits[rows], tgt[rows], c.pad_id, 0.1)
        means.append(mean)
        sums.append(mean * n)
    # The trap: 7e-3 here, a different loss, where rounding would be about 1e-15.
    assert abs(np.mean(means) - whole) > 1e-3
    summed = sum(s * replica_loss_scale(tokens, 2, engine_averages=False) for s in sums)
    averaged = np.mean([s * replica_loss_scale(tokens, 2, engine_averages=True) for s in sums])
    assert summed == pytest.approx(whole, rel=1e-15, abs=0)
    assert averaged == pytest.approx(whole, rel=1e-15, abs=0)
    assert replica_loss_scale(0, 2, engine_averages=False) == 1.0  # all pad: loss 0, not 0 / 0


def test_grouped_key_value_heads_must_divide_over_the_model_shards():
    """Megatron splits the key/value heads as it splits the query heads: 1 of them cannot go to
    2 shards (JAX would stop inside the compiler with IndivisibleError)."""
    from transformer_rosetta.spec.config import preset
    from transformer_rosetta.spec.mesh import MeshShape, mesh_problems

    llama = preset("tiny_llama")  # 4 query heads, 2 key/value heads
    assert mesh_problems(MeshShape(1, 2), llama) == []
    assert mesh_problems(MeshShape(1, 2), llama.replace(num_kv_heads=1)) == [
        "num_kv_heads=1 does not divide over model=2 shards"
    ]
