"""The hash-agreement handshake: what a router must share with a worker to compute the same block hashes.

A cache-aware router hashes prompts itself and looks the hashes up in an index fed by the workers' KV
events. If its tokenizer, block size or hashing scheme differ from a worker's even slightly, every lookup
misses and routing silently degrades to random (a known failure of other routers). So the worker
describes its scheme at `GET /kv/config`, the router computes the same description from its own
tokenizer and kvyard's own hashing code, and refuses a worker whose description differs.
"""

import hashlib
import json
from typing import Any

import msgspec

from kvyard.engine.block_manager import HASH_FUNCTION, ROOT_HASH

# How a request's cache salt enters the hash. The HTTP API takes no `cache_salt` yet: a request for the base
# model hashes with the empty salt, and one for a LoRA adapter with the adapter's content digest (bytes of its
# sha256, kvyard/lora/adapter.py), so the router's hashes of adapter requests find nothing (a cache miss, never a
# wrong hit) until it learns the digests. Whoever wires vLLM's `cache_salt` field in changes this string.
SALT_SCHEME = "base model: the empty salt; a LoRA adapter: its content digest"

# The fields that decide whether two sides compute identical hashes for identical requests.
HASH_FIELDS = ("block_size", "hash_function", "hash_seed", "salt_scheme", "tokenizer_fingerprint")


class KVConfig(msgspec.Struct, frozen=True):
    model: str  # the served model name
    block_size: int
    hash_function: str
    hash_seed: str  # hex of the root parent hash
    salt_scheme: str
    tokenizer_fingerprint: str
    enable_prefix_caching: bool = True
    instance_id: str = ""  # new on every start of the worker, so a restart is visible
    events_endpoint: str | None = None  # tcp://host:port of the KV event PUB socket; None: no events
    role: str = "both"  # prefill / decode / both (disaggregated serving, kvyard/server/disagg.py)
    kv_transfer_endpoint: str | None = None  # where decode workers pull this worker's prefilled KV
    # The LoRA adapters it serves now: name -> content digest (hex), each adapter's requests' salt
    lora_adapters: dict[str, str] = msgspec.field(default_factory=dict)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of everything that decides which token ids a prompt becomes: the tokenizer's JSON (vocab,
    merges, normalizer, pre/post-processors), its special tokens and the chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer)).encode())
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(special, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def local_kv_config(model: str, block_size: int, tokenizer: Any, **extra: Any) -> KVConfig:
    """The description of kvyard's own hashing code with this tokenizer (both sides call this)."""
    return KVConfig(
        model=model,
        block_size=block_size,
        hash_function=HASH_FUNCTION,
        hash_seed=ROOT_HASH.hex(),
        salt_scheme=SALT_SCHEME,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        **extra,
    )


def hash_mismatches(expected: KVConfig, got: KVConfig) -> list[str]:
    """Human-readable differences in the fields that decide block hashes; empty when they agree."""
    out = []
    for name in HASH_FIELDS:
        a, b = getattr(expected, name), getattr(got, name)
        if a != b:
            out.append(f"{name}: expected {a!r}, worker has {b!r}")
    return out
