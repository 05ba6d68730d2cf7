"""Prefix-cache block hashes: SHA-256 chained over (parent hash, block token ids), salted.

Block i's hash is ``SHA-256(hash(i-1) || tokens of block i as little-endian int64)``, and
block 0's parent is ``SHA-256("kvloop-prefix-v1" || salt)``. So equal hashes mean equal
whole prefixes under the same salt, and the value is the same in every process and on
every machine (routing between replicas can rely on it).

NOTE: SHA-256 is collision resistant, so a hit is not re-checked against the tokens: two
different prompts (or two tenants' salts) sharing KV would take a SHA-256 collision. A
fast non-cryptographic hash (Python's ``hash()``, xxHash) would let a hostile client craft
a prompt whose blocks alias another tenant's cached KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_VERSION = b"kvloop-prefix-v1"


def root_hash(salt: str | None) -> bytes:
    """The parent of a request's first block: depends on the cache salt only."""
    data = _VERSION if salt is None else _VERSION + b"\0" + salt.encode()
    return hashlib.sha256(data).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes that are hashed (little-endian int64, one C call)."""
    buf = array("q", token_ids)
    if buf.itemsize != 8:  # pragma: no cover - array('q') is 8 bytes on every platform
        raise RuntimeError("array('q') is not 64-bit here")
    return buf.tobytes() if _LITTLE else _swapped(buf)


def chain_hashes(parent: bytes, data: bytes, block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of ``num_blocks`` consecutive blocks whose token bytes start ``data``."""
    sha = hashlib.sha256
    step = 8 * block_size
    out = []
    for i in range(num_blocks):
        parent = sha(parent + data[i * step:(i + 1) * step]).digest()
        out.append(parent)
    return out


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one block of ``token_ids`` after ``parent``."""
    return chain_hashes(parent, token_bytes(token_ids), len(token_ids), 1)[0]


def _swapped(buf: array) -> bytes:  # pragma: no cover - big-endian hosts only
    buf.byteswap()
    return buf.tobytes()


_LITTLE = array("H", [1]).tobytes() == b"\x01\x00"
