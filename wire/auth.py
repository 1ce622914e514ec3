"""The worker link's shared secret: a worker started with a token sends CHALLENGE (a
fresh random nonce) before HELLO, and serves only a frontend whose AUTH carries
HMAC-SHA256(token, ``lifecycle-worker-auth`` + nonce). The token never crosses the wire;
a recorded AUTH is useless against the next nonce. Both ends read the token from a flag
or from ``LIFECYCLE_WORKER_TOKEN`` (the environment keeps it out of ``ps``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = ["TOKEN_ENV", "auth_mac", "check_mac", "new_nonce", "resolve_token"]

TOKEN_ENV = "LIFECYCLE_WORKER_TOKEN"
_CONTEXT = b"lifecycle-worker-auth"


def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def auth_mac(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), _CONTEXT + nonce, hashlib.sha256).digest()


def check_mac(token: str, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(auth_mac(token, nonce), mac)


def resolve_token(flag: str | None) -> str | None:
    """The flag's token, else the environment's; None when neither is set. An empty
    token is refused: it would authenticate anyone who knows the scheme."""
    token = flag if flag is not None else os.environ.get(TOKEN_ENV)
    if token is None:
        return None
    if not token.strip():
        raise ValueError(f"the worker token is empty (--worker-token / {TOKEN_ENV})")
    return token
