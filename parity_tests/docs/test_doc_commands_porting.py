"""The blocks of docs/PORTING.md run as the doc says: the convention and the runner are
test_doc_commands.py's (its module docstring); this file holds PORTING.md's share of the blocks
(RUN_BY_FILE), which in one file with the others would take it past 2 minutes."""

from __future__ import annotations

import pytest

from parity_tests.docs.test_doc_commands import RUN_BY_FILE, Block, cases, made, run_case

THERE = RUN_BY_FILE["test_doc_commands_porting.py"]
__all__ = ["made"]  # the shared module-scoped fixture of setups


@pytest.mark.parametrize("blocks", cases(THERE))
def test_the_block_runs_as_the_doc_says(blocks: list[Block], made, tmp_path):  # noqa: F811
    """Each block of PORTING.md, as test_doc_commands.py runs its own."""
    run_case(blocks, made, tmp_path)


def test_inline_config_json_works_as_porting_md_writes_it(made, tmp_path):
    """PORTING.md's prose gives `--config '{"pad_id": N}'`, the JSON itself on the command line
    (common/spec/config.py, is_inline_json): typed as written into a shell, it sets the pad."""
    import re

    from parity_tests.docs.test_doc_commands import ROOT, run_bash
    from transformer_rosetta.weights.format import load_weights

    shown = set(
        re.findall(r"`(--config '\{\"pad_id\": N\}')`", (ROOT / "docs/PORTING.md").read_text())
    )
    assert shown == {"""--config '{"pad_id": N}'"""}, shown
    made(["qwen2_folder"], tmp_path)
    flag = shown.pop().replace("N", "5")
    done = run_bash(f"rosetta convert ./Qwen2-0.5B q.safetensors {flag} --no-verify", tmp_path)
    assert done.returncode == 0, done.stderr
    assert load_weights(tmp_path / "q.safetensors").config.pad_id == 5
