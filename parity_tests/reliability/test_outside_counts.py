"""Issue 41, class 2: every count that an outside config gives (layers, heads, key/value heads,
vocabulary, positions, hidden and intermediate sizes) is compared with the tensors the file holds
before any work proportional to it (common/porting/table.py, check_counts; docs/RELIABILITY.md,
"Limits").

Before the fix, a config.json with `num_hidden_layers: 1000000000` over a file of 2 layers ran for
minutes with growing memory: the importer built a name for each of the 10^9 layers (the table's
resolve, through canonical_specs) before it compared any shape. A huge head_dim allocated the
rotary frequencies of head_dim before any shape was looked at, and a random-init `--config` with
10^9 layers hung in its own memory estimate (parameter_count named every layer).

Each importer's fixture is a real small model saved the way its users save it (transformers'
save_pretrained, a torch.save state dict, Meta's params.json with consolidated.00.pth written as
parity_tests/porting/test_meta_llama.py writes it). Its config then gets a huge count, and a
slightly wrong one: each is refused in one line, exit 2, naming the outside key, its value and what
the file holds. The counts that once hung run in a fresh process under a timeout (a hang fails
the test instead of stalling the run); every case also runs through the Python API
(`transformer_rosetta.convert`), which must raise a RosettaError subclass within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity_tests.cli.command_line import one_line_error, run
from parity_tests.conftest import import_or_skip
from parity_tests.paths import ROOT

torch = import_or_skip("torch", "the fixtures are torch models saved as their users save them")
transformers = import_or_skip("transformers", "the fixtures are transformers' own models")

import transformer_rosetta as tr  # noqa: E402
from parity_tests.porting.test_meta_llama import PARAMS, meta_state, write_meta  # noqa: E402
from transformer_rosetta.errors import RosettaError  # noqa: E402

B = 10**9  # a count no file here holds: the old code's work grew with it
# The old code ran for minutes at these counts; a fresh process must answer well inside this.
TIMEOUT_S = 60
# In-process, a refusal costs the header read and one pass over the keys: milliseconds for these
# files. 5 s leaves a loaded 2-core machine its slack and is still far from proportional work.
API_SECONDS = 5.0
IDS = {"bos_id": 1, "eos_id": 2}  # what a Qwen2 config.json and Meta's params.json do not tell

LLAMA = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _llama_family(config_class, model_class, **extra):
    torch.manual_seed(0)
    return model_class(config_class(**{**LLAMA, **extra})).eval()


def _make(kind: str, folder: Path) -> Path:
    """The fixture `kind`, written under `folder`: the folder or file to convert."""
    if kind == "llama":
        _llama_family(transformers.LlamaConfig, transformers.LlamaForCausalLM).save_pretrained(
            folder
        )
    elif kind == "llama-sharded":
        model = _llama_family(transformers.LlamaConfig, transformers.LlamaForCausalLM)
        model.save_pretrained(folder, max_shard_size="20KB")
        assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    elif kind == "llama-bin":  # the older pytorch_model.bin layout, read with weights_only
        model = _llama_family(transformers.LlamaConfig, transformers.LlamaForCausalLM)
        model.save_pretrained(folder)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    elif kind == "mistral":
        model = _llama_family(
            transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=None
        )
        model.save_pretrained(folder)
    elif kind == "qwen2":
        _llama_family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM).save_pretrained(
            folder
        )
    elif kind == "meta":  # PARAMS' d_ff by Meta's formula (multiple_of 16, 1.3) is 112
        model = _llama_family(
            transformers.LlamaConfig, transformers.LlamaForCausalLM, intermediate_size=112
        )
        write_meta(folder, [meta_state(model)], PARAMS)
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=61,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=20,
            bos_token_id=4,
            eos_token_id=5,
        )
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    elif kind == "bert":
        config = transformers.BertConfig(
            vocab_size=40,
            hidden_size=8,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=12,
            max_position_embeddings=16,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(0)
        transformers.BertModel(config).save_pretrained(folder)
    elif kind == "marian":  # 2 encoder layers, 1 decoder layer, one shared matrix
        config = transformers.MarianConfig(
            vocab_size=60,
            d_model=16,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_layers=2,
            decoder_layers=1,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            pad_token_id=59,
            decoder_start_token_id=59,
            eos_token_id=0,
        )
        torch.manual_seed(0)
        transformers.MarianMTModel(config).save_pretrained(folder)
    elif kind == "nn-transformer":  # a user's pipeline around torch.nn.Transformer
        from parity_tests.porting.test_nn_transformer import case_config, random_pipeline

        folder.mkdir(parents=True)
        config = case_config("post-relu")
        torch.save(random_pipeline(config).state_dict(), folder / "pipeline.pt")
        (folder / "config.json").write_text(json.dumps(config.to_dict()))
        return folder / "pipeline.pt"
    elif kind == "encoder-gpt":  # seed text 002's GPT, whose positions are computed
        from parity_tests.fixtures import seed_gpt
        from parity_tests.porting.test_gpt import IDS as GPT_IDS
        from parity_tests.porting.test_gpt import LAYERS

        folder.mkdir(parents=True)
        torch.save(seed_gpt.make_model(LAYERS, seed=7).state_dict(), folder / "model.pt")
        (folder / "config.json").write_text(json.dumps(GPT_IDS))
        return folder / "model.pt"
    else:
        raise AssertionError(kind)
    return folder


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """kind -> its saved model (made once, on first use)."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = _make(kind, tmp_path_factory.mktemp(kind) / "model")
        return made[kind]

    return get


# kind -> (--from, the JSON file a case edits: the outside config, or --config's own)
KINDS = {
    "llama": ("llama", "config.json"),
    "llama-sharded": ("llama", "config.json"),
    "llama-bin": ("llama", "config.json"),
    "mistral": ("llama", "config.json"),
    "qwen2": ("llama", "config.json"),
    "meta": ("meta-llama", "params.json"),
    "gpt2": ("gpt2", "config.json"),
    "bert": ("bert", "config.json"),
    "marian": ("marian", "config.json"),
    "nn-transformer": ("nn-transformer", "--config"),
    "encoder-gpt": ("encoder-gpt", "--config"),
}
# What --config adds where the outside config does not tell it.
# (Meta: max_len is then ModelArgs' 2048, or params.json's max_seq_len.)
GIVEN = {"qwen2": IDS, "meta": IDS}


def prepared(fixtures, kind: str, changes: dict, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the fixture whose config takes `changes`, and the CLI's options for it."""
    source = fixtures(kind)
    from_kind, edited = KINDS[kind]
    folder = source if source.is_dir() else source.parent
    copy = shutil.copytree(folder, tmp_path / "src")
    options = ["--from", from_kind, "--no-verify"]
    given = dict(GIVEN.get(kind, {}))
    if edited == "--config":  # the user's own config is the outside one
        given = {**json.loads((copy / "config.json").read_text()), **changes}
    else:
        path = copy / edited
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    if given:
        (tmp_path / "given.json").write_text(json.dumps(given))
        options += ["--config", str(tmp_path / "given.json")]
    src = copy if source.is_dir() else copy / source.name
    return src, options


def api_refuses(src: Path, dst: Path, options: list[str], *needles: str) -> None:
    """transformer_rosetta.convert refuses with a RosettaError subclass holding every needle,
    within API_SECONDS, and writes nothing."""
    from_kind = options[options.index("--from") + 1]
    config = None
    if "--config" in options:
        config = json.loads(Path(options[options.index("--config") + 1]).read_text())
    start = time.monotonic()
    with pytest.raises(RosettaError) as err:
        tr.convert(src, dst, from_kind=from_kind, config=config, verify=False)
    elapsed = time.monotonic() - start
    assert elapsed < API_SECONDS, f"{elapsed:.1f} s: work proportional to the count?"
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert not dst.exists()


def fresh_process(*argv: object) -> subprocess.CompletedProcess:
    """`rosetta ARGV...` in a new interpreter, killed (and the test failed) past TIMEOUT_S."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "transformer_rosetta", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


# -- the counts whose work once grew with them: a fresh process, under a timeout ------------------

HUNG = {
    # kind, changes, what the line names
    "llama layers": ("llama", {"num_hidden_layers": B}, ("Llama num_hidden_layers", "2 layers")),
    "llama head_dim": (  # the rotary frequencies of head_dim were allocated first
        "llama",
        {"head_dim": B},
        ("num_attention_heads", "head_dim 1000000000", "q_proj.weight is [32, 32]"),
    ),
    "sharded llama layers": (
        "llama-sharded",
        {"num_hidden_layers": B},
        ("Llama num_hidden_layers", "2 layers"),
    ),
    "llama .bin layers": ("llama-bin", {"num_hidden_layers": B}, ("num_hidden_layers", "2 layers")),
    "mistral layers": ("mistral", {"num_hidden_layers": B}, ("Mistral num_hidden_layers",)),
    "qwen2 layers": ("qwen2", {"num_hidden_layers": B}, ("Qwen2 num_hidden_layers", "2 layers")),
    # transformers 4's config.json has no layer_types: the sliding-window check once listed a
    # layer type per num_hidden_layers to find it.
    "qwen2 layers, no layer_types": (
        "qwen2",
        {"num_hidden_layers": B, "layer_types": None},
        ("Qwen2 num_hidden_layers", "2 layers"),
    ),
    "meta layers": ("meta", {"n_layers": B}, ("Meta Llama n_layers", "2 layers")),
    "meta dim": ("meta", {"dim": B}, ("Meta Llama dim", "1000000000")),
    "gpt2 layers": ("gpt2", {"n_layer": B}, ("GPT-2 n_layer", "2 layers")),
    "bert layers": ("bert", {"num_hidden_layers": B}, ("BERT num_hidden_layers", "2 layers")),
    "marian encoder layers": ("marian", {"encoder_layers": B}, ("Marian encoder_layers",)),
    "marian decoder layers": (
        "marian",
        {"decoder_layers": B},
        ("Marian decoder_layers", "1 layer"),
    ),
    "nn.Transformer layers": (
        "nn-transformer",
        {"num_decoder_layers": B},
        ("num_decoder_layers: 1000000000", "1 layer"),
    ),
    "encoder-gpt computed positions": (
        "encoder-gpt",
        {"max_len": 10**12},
        ("decoder.position_embedding [1000000000000, 12], computed from the config",),
    ),
}


@pytest.mark.parametrize("case", list(HUNG))
def test_a_huge_count_is_refused_in_a_fresh_process_within_the_timeout(fixtures, tmp_path, case):
    kind, changes, needles = HUNG[case]
    src, options = prepared(fixtures, kind, changes, tmp_path)
    dst = tmp_path / "out.safetensors"
    value = str(next(iter(changes.values())))
    proc = fresh_process("convert", src, dst, *options)  # TimeoutExpired: it hangs
    assert proc.returncode == 2, proc.stderr
    one_line_error(proc.returncode, proc.stderr, value, *needles)
    assert "Traceback" not in proc.stderr
    assert not dst.exists()
    api_refuses(src, dst, options, value, *needles)


# -- every other count, huge and slightly wrong: in this process ------------------------------------

COUNTS = {
    "llama 3 layers": ("llama", {"num_hidden_layers": 3}, ("num_hidden_layers", "2 layers")),
    "llama heads": (
        "llama",
        {"num_attention_heads": B},
        ("Llama num_attention_heads", "8000000000", "q_proj.weight is [32, 32]"),
    ),
    # 4 key/value heads of 8 need 32 rows of k_proj; the file's has 2 heads, 16 rows.
    "llama kv heads": (
        "llama",
        {"num_key_value_heads": 4},
        ("Llama num_key_value_heads", "need 32", "k_proj.weight is [16, 32]"),
    ),
    "llama vocabulary": (
        "llama",
        {"vocab_size": B},
        ("Llama vocab_size", "embed_tokens.weight is [61, 32]"),
    ),
    "llama hidden size": ("llama", {"hidden_size": B}, ("Llama hidden_size",)),
    "llama intermediate size": (
        "llama",
        {"intermediate_size": 65},
        ("Llama intermediate_size", "gate_proj.weight is [64, 32]"),
    ),
    # Rotary positions: no tensor tells max_len, the models' tables of it need memory.
    "llama positions": (
        "llama",
        {"max_position_embeddings": 10**15},
        ("Llama max_position_embeddings", "rotary position table", "GiB"),
    ),
    "sharded llama vocabulary": ("llama-sharded", {"vocab_size": 62}, ("Llama vocab_size",)),
    "qwen2 3 layers": ("qwen2", {"num_hidden_layers": 3}, ("Qwen2 num_hidden_layers",)),
    "meta 3 layers": ("meta", {"n_layers": 3}, ("Meta Llama n_layers", "2 layers")),
    "meta kv heads": (
        "meta",
        {"n_kv_heads": 4},
        ("Meta Llama n_kv_heads", "wk.weight is [16, 32]"),
    ),
    "meta vocabulary": ("meta", {"vocab_size": B}, ("Meta Llama vocab_size", "[61, 32]")),
    "meta positions": ("meta", {"max_seq_len": 10**15}, ("Meta Llama max_seq_len", "GiB")),
    "gpt2 3 layers": ("gpt2", {"n_layer": 3}, ("GPT-2 n_layer", "2 layers")),
    "gpt2 vocabulary": ("gpt2", {"vocab_size": B}, ("GPT-2 vocab_size", "wte.weight is [61, 16]")),
    "gpt2 positions": ("gpt2", {"n_positions": B}, ("GPT-2 n_positions", "wpe.weight is [16, 16]")),
    "gpt2 width": ("gpt2", {"n_embd": B}, ("GPT-2 n_embd",)),
    "bert 3 layers": ("bert", {"num_hidden_layers": 3}, ("BERT num_hidden_layers", "2 layers")),
    "bert vocabulary": ("bert", {"vocab_size": B}, ("BERT vocab_size", "[40, 8]")),
    "bert positions": (
        "bert",
        {"max_position_embeddings": B},
        ("BERT max_position_embeddings", "position_embeddings.weight is [16, 8]"),
    ),
    "bert segments": (
        "bert",
        {"type_vocab_size": B},
        ("BERT type_vocab_size", "token_type_embeddings.weight is [2, 8]"),
    ),
    "bert intermediate size": ("bert", {"intermediate_size": 13}, ("BERT intermediate_size",)),
    "marian 2 decoder layers": (
        "marian",
        {"decoder_layers": 2},
        ("Marian decoder_layers", "1 layer"),
    ),
    "marian vocabulary": (
        "marian",
        {"vocab_size": B, "decoder_vocab_size": B},
        ("Marian decoder_vocab_size", "final_logits_bias is [1, 60]"),
    ),
    "marian width": ("marian", {"d_model": B}, ("Marian d_model", "fc1.weight is [32, 16]")),
    # Sinusoidal positions: computed, never stored; the models' tables of them need memory.
    "marian positions": (
        "marian",
        {"max_position_embeddings": B},
        ("Marian max_position_embeddings", "sinusoidal position table", "GiB"),
    ),
    "nn.Transformer 3 layers": (
        "nn-transformer",
        {"num_encoder_layers": 3},
        ("num_encoder_layers",),
    ),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_a_count_the_file_cannot_hold_is_refused_naming_its_key(fixtures, tmp_path, capsys, case):
    kind, changes, needles = COUNTS[case]
    src, options = prepared(fixtures, kind, changes, tmp_path)
    dst = tmp_path / "out.safetensors"
    value = str(next(iter(changes.values())))
    capsys.readouterr()  # save_pretrained's progress bar, shown unless an earlier test hid it
    start = time.monotonic()
    code, _, err = run(capsys, "convert", src, dst, *options)
    assert time.monotonic() - start < API_SECONDS, err
    one_line_error(code, err, value, *needles)
    assert not dst.exists()
    api_refuses(src, dst, options, value, *needles)


def gapped_llama(tmp_path: Path, layers: int) -> Path:
    """A 3-layer Llama saved with save_pretrained, layer 1's tensors then left out of its
    model.safetensors (layers 0 and 2 held), its config.json saying `layers`."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "gapped"
    _llama_family(
        transformers.LlamaConfig, transformers.LlamaForCausalLM, num_hidden_layers=3
    ).save_pretrained(folder)
    weights = folder / "model.safetensors"
    state = {
        k: v for k, v in load_file(str(weights)).items() if not k.startswith("model.layers.1.")
    }
    save_file(state, str(weights), metadata={"format": "pt"})
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": layers}))
    return folder


@pytest.mark.parametrize("layers", [2, 3])
def test_a_folder_whose_layers_have_a_gap_is_refused_by_the_count(tmp_path, capsys, layers):
    """Layers 0 and 2 are neither 2 layers (the last index is not 1) nor 3 (two are held): each
    count is refused naming config.json's key and the indices the file holds, before any
    tensor is read (table.py, count_problems)."""
    src = gapped_llama(tmp_path, layers)
    options = ["--from", "llama", "--no-verify"]
    dst = tmp_path / "out.safetensors"
    held = "but the file holds 2 layers (model.layers.{i} for i = 0, 2)"
    needles = (f"Llama num_hidden_layers): {layers}, {held}",)
    capsys.readouterr()  # save_pretrained's progress bar
    code, _, err = run(capsys, "convert", src, dst, *options)
    one_line_error(code, err, *needles)
    assert not dst.exists()
    api_refuses(src, dst, options, *needles)


def test_the_unchanged_fixtures_still_import(fixtures, tmp_path):
    """The check refuses what the file cannot hold, not the models it holds: every fixture,
    unchanged, converts."""
    for kind in KINDS:
        src, options = prepared(fixtures, kind, {}, tmp_path / kind)
        from_kind = options[options.index("--from") + 1]
        config = None
        if "--config" in options:
            config = json.loads(Path(options[options.index("--config") + 1]).read_text())
        dst = tmp_path / f"{kind}.safetensors"
        tr.convert(src, dst, from_kind=from_kind, config=config, verify=False)
        assert dst.exists(), kind


# -- a random-init --config: the memory estimate, without naming a tensor per layer ---------------

RANDOM = {
    "src_vocab_size": 61,
    "tgt_vocab_size": 61,
    "d_model": 32,
    "num_heads": 4,
    "d_ff": 64,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "max_len": 64,
}


@pytest.mark.parametrize(
    "changes",
    [{"num_decoder_layers": B}, {"max_len": 10**12}],
    ids=["layers", "sinusoidal positions"],
)
def test_random_weights_for_a_huge_config_are_refused_by_the_memory_estimate(tmp_path, changes):
    """10^9 layers of this width are about 4e14 bytes of float64 weights, 10^12 sinusoidal
    positions 2 stacks x 10^12 x 32 x 8 = 5e14 bytes of position tables: no machine here has
    that. The estimate counts one layer times the layer count, and the tables each framework
    computes when it builds the model."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RANDOM, **changes}))
    proc = fresh_process("parity", "--config", path)
    one_line_error(proc.returncode, proc.stderr, "random float64 weights", "GiB of memory")
