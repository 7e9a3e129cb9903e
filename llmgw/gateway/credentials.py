"""The client's key: read from the request and checked."""

from __future__ import annotations

import logging

from llmgw.asgi import Scope
from llmgw.auth.keys import KeyAuthenticator
from llmgw.errors import StoreError, describe
from llmgw.store import KeyRecord

from .errors import unauthorized
from .http import header

__all__ = ["authenticate"]

log = logging.getLogger("llmgw.gateway")


async def authenticate(authenticator: KeyAuthenticator, scope: Scope) -> KeyRecord:
    """The live key the request presents: ``Authorization: Bearer <key>``,
    or ``x-api-key: <key>`` (Anthropic's clients).

    Raises:
        ApiError: 401 ``invalid_api_key``: no key, or not a bearer one.
        KeyRefused: 401: the key is unknown, revoked or expired.
        StoreError: the key cannot be checked (logged).
    """
    value = header(scope, b"authorization")
    if not value:
        value = header(scope, b"x-api-key")
        if value:
            value = b"Bearer " + value
    if not value:
        raise unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-llmgw-…' "
            "(or 'x-api-key: sk-llmgw-…', as Anthropic's clients do)."
        )
    scheme, _, secret = value.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise unauthorized("The Authorization header must be 'Bearer <key>'.")
    try:
        return await authenticator.check(secret.strip())
    except StoreError as exc:
        log.error("cannot check a key: %s", describe(exc))
        raise
