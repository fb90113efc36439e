"""Prompt prefix blocks: hashed once at the edge, carried down in metadata.

A prompt is cut into blocks of ``BLOCK_TOKENS`` whitespace tokens; block i's
hash covers blocks 0..i (a chain), so two prompts share their first k block
hashes exactly when they share their first k blocks. The emulated GPU's
prefix cache uses the same function, so the router's view and the GPU's
cache agree on what a block is.
"""

from __future__ import annotations

import hashlib

from common.basics.errors import RouteError

BLOCK_TOKENS = 16
# Hashes carried between tiers: 64 blocks = the first 1024 tokens, ~1.1 KB of metadata.
MAX_CARRIED_BLOCKS = 64
PREFIX_BLOCKS = "x-meridian-prefix-blocks"


def prompt_block_hashes(prompt: str, *, model: str = "", limit: int | None = None) -> list[int]:
    """Chained 64-bit hashes of the prompt's whole blocks (at most ``limit``).

    blake2b rather than ``hash()`` so that every process computes the same values.
    """
    words = prompt.split()
    digest = hashlib.blake2b(model.encode(), digest_size=8).digest()
    hashes = []
    stop = len(words) - BLOCK_TOKENS + 1
    if limit is not None:
        stop = min(stop, limit * BLOCK_TOKENS)
    for start in range(0, stop, BLOCK_TOKENS):
        block = " ".join(words[start : start + BLOCK_TOKENS]).encode()
        digest = hashlib.blake2b(digest + block, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
    return hashes


def encode_blocks(hashes: list[int]) -> str:
    """Metadata value: hex hashes joined by '.' (at most ``MAX_CARRIED_BLOCKS``)."""
    return ".".join(f"{h:016x}" for h in hashes[:MAX_CARRIED_BLOCKS])


def decode_blocks(value: str) -> list[int]:
    """Inverse of ``encode_blocks``; INVALID_ARGUMENT naming the key when malformed."""
    if not value:
        return []
    parts = value.split(".")
    # int(p, 16) alone also reads a sign, "_" and spaces: "-fffffffffffffff" is no hash.
    if len(parts) > MAX_CARRIED_BLOCKS or not all(
        len(p) == 16 and p.isascii() and p.isalnum() for p in parts
    ):
        raise RouteError.invalid(f"metadata '{PREFIX_BLOCKS}' is malformed")
    try:
        return [int(p, 16) for p in parts]
    except ValueError:
        raise RouteError.invalid(f"metadata '{PREFIX_BLOCKS}' is malformed") from None
