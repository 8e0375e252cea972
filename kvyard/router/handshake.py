"""Registration handshake: fetch a worker's `GET /kv/config` and refuse it, loudly, if its block hashes
would differ from ours (kvyard/server/kv_config.py explains why this matters)."""

import httpx
import msgspec

from kvyard.cluster.auth import HEADER
from kvyard.errors import KvyardError
from kvyard.server.kv_config import KVConfig, hash_mismatches


class HandshakeError(KvyardError):
    """The worker's hashing scheme or model differs from the router's, or it refused the router's key: it
    must not be routed to."""

    def __init__(self, url: str, problems: list[str]):
        super().__init__(f"refusing worker {url}: " + "; ".join(problems))
        self.url = url
        self.problems = problems


async def fetch_kv_config(client: httpx.AsyncClient, url: str, timeout: float) -> KVConfig:
    """Raises httpx errors when the worker does not answer, HandshakeError when it answers wrongly."""
    r = await client.get(url + "/kv/config", timeout=timeout)
    if r.status_code in (401, 403) and _error_code(r) == "invalid_cluster_token":
        token = "a cluster token it refused" if HEADER in client.headers else "no cluster token"
        raise HandshakeError(url, [f"it answered {r.status_code}: the router sent {token}; a worker of another "
                                   "deployment, or one started without this deployment's $KVYARD_CLUSTER_TOKEN"])
    if r.status_code in (401, 403):
        key = "a key it refused" if "authorization" in client.headers else "no key"
        raise HandshakeError(url, [f"it answered {r.status_code}: the router sent {key}; start the router "
                                   "with the workers' key (--api-key or --worker-api-key)"])
    if r.status_code == 404:
        raise HandshakeError(url, ["it has no /kv/config (not a kvyard worker, or an older one)"])
    r.raise_for_status()
    try:
        return msgspec.json.decode(r.content, type=KVConfig)
    except msgspec.ValidationError as e:
        raise HandshakeError(url, [f"/kv/config is malformed: {e}"]) from None


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def check_config(url: str, expected: KVConfig, got: KVConfig, model: str | None) -> None:
    """`expected` is the router's own scheme; `model` the served model name the other workers agreed on."""
    problems = hash_mismatches(expected, got)
    if model is not None and got.model != model:
        problems.append(f"model: the other workers serve {model!r}, this one {got.model!r}")
    if problems:
        raise HandshakeError(url, problems)
