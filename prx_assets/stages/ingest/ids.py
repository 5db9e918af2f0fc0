"""Sample ids: stable across reruns, unique across the corpus, never from a counter."""

from __future__ import annotations

import hashlib

# 96 bits: at a billion items per source the chance of any collision is ~1e-11.
_ID_HEX_CHARS = 24


def sample_id(source: str, key: str) -> str:
    """`<source>:<hash of key>`: the source prefix keeps ids readable and corpus-unique."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=_ID_HEX_CHARS // 2).hexdigest()
    return f"{source}:{digest}"
