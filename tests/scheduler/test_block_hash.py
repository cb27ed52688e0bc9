"""Chained block hashes: stable across processes, sensitive to every input."""

import subprocess
import sys
from pathlib import Path

from services.scheduler.block_hash import extend_block_hashes, hash_block_tokens


def test_hash_is_stable_across_processes():
    code = (
        "from services.scheduler.block_hash import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4], ('salt',)).hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed)}, cwd=Path(__file__).parents[2]).stdout.strip()
        for seed in (1, 2)
    }
    assert outs == {hash_block_tokens(None, [1, 2, 3, 4], ("salt",)).hex()}


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("ab",)) != hash_block_tokens(None, [1, 2, 3, 4], ("a", "b"))


def test_extend_block_hashes_chains_full_blocks_only():
    hashes: list[bytes] = []
    tokens = list(range(10))
    extend_block_hashes(hashes, tokens, 4)
    assert len(hashes) == 2  # 10 tokens = 2 full blocks of 4
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    tokens += [10, 11]
    extend_block_hashes(hashes, tokens, 4)
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, 4, cache_salt="user-1")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
