"""The blocks of docs/DISTRIBUTED.md run as the doc says, the commands for several hosts as two
local processes (their markers say how): the convention and the runner are test_doc_commands.py's
(its module docstring); this file holds DISTRIBUTED.md's share of the blocks (RUN_BY_FILE)."""

from __future__ import annotations

import pytest

from parity_tests.docs.test_doc_commands import RUN_BY_FILE, Block, cases, made, run_case

THERE = RUN_BY_FILE["test_doc_commands_distributed.py"]
__all__ = ["made"]  # the shared module-scoped fixture of setups


@pytest.mark.parametrize("blocks", cases(THERE))
def test_the_block_runs_as_the_doc_says(blocks: list[Block], made, tmp_path):  # noqa: F811
    """Each block of DISTRIBUTED.md, as test_doc_commands.py runs its own."""
    run_case(blocks, made, tmp_path)
