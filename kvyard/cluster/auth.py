"""The cluster token: what lets one kvyard process into another's cluster-internal endpoints.

A fleet's internal traffic (the router reading `/kv/*` and subscribing to KV events, a decode worker pulling
KV from a prefill worker over ZeroMQ) must come from the fleet itself. `kvyard up` (and the Ray controller)
draws a random token per deployment and gives it to every worker and the router in their environment
(`KVYARD_CLUSTER_TOKEN`), never on a command line. Then:

* HTTP: `/kv/*` answers only a request with `X-Kvyard-Cluster-Token: TOKEN`, or the API key when the worker
  has one (an operator's tool);
* ZeroMQ: the KV-event publisher and the KV-transfer source accept only connections that authenticate with
  ZeroMQ's PLAIN mechanism and the token as password (checked by pyzmq's ZAP authenticator). PLAIN sends the
  token in the clear: it keeps out what is not the fleet, not a listener on the fleet's own network.
"""

import hmac
import os
import secrets

import zmq
from zmq.auth.thread import ThreadAuthenticator

TOKEN_ENV = "KVYARD_CLUSTER_TOKEN"
HEADER = "x-kvyard-cluster-token"
_USER = b"kvyard"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def token_matches(given: str | None, token: str) -> bool:
    # Constant time: a response's timing must not leak the token.
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def guard_server_socket(ctx: zmq.Context, sock: zmq.Socket, token: str | None) -> ThreadAuthenticator | None:
    """Before `sock` binds: only peers that present `token` get through (None: anyone). The authenticator
    runs a thread on `ctx`; stop it when the socket closes."""
    if token is None:
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={_USER.decode(): token})
    sock.plain_server = True
    return auth


def present_token(sock: zmq.Socket, token: str | None) -> None:
    """Before `sock` connects: authenticate with `token` (None: no credentials)."""
    if token is not None:
        sock.plain_username = _USER
        sock.plain_password = token.encode()
