"""Reading and checking a client's request body (``docs/api.md``), and the
token estimates limits and budgets hold before the real count is known.

Pure but for :func:`read_body`; every refusal is an
:class:`~llmgw.gateway.errors.ApiError` naming the field at fault.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from llmgw.asgi import Receive, Scope
from llmgw.engines.registry import unsupported_request
from llmgw.store import ModelRecord

from .errors import ApiError, bad_request
from .http import header

__all__ = [
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "ESTIMATE_KIND",
    "MAX_BODY_BYTES",
    "check_for_model",
    "estimate_prompt_tokens",
    "estimate_tokens",
    "parse_body",
    "read_body",
]

#: Largest request body accepted, in bytes (the sample proxy's 32 MB).
MAX_BODY_BYTES: Final = 32 * 1024 * 1024

#: The kind whose shape :func:`estimate_prompt_tokens` reads, after translation.
ESTIMATE_KIND: Final = {
    "chat": "chat",
    "completions": "completions",
    "embeddings": "embeddings",
    "messages": "chat",
    "responses": "chat",
}

#: Output tokens assumed for a request that gives no max_tokens, when
#: estimating what it will spend (the model's max_output comes with the catalog).
DEFAULT_MAX_OUTPUT_TOKENS: Final = 512


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes.

    Raises:
        ApiError: 413 ``request_too_large`` (by ``content-length`` or as it
            comes), 499 ``client_closed`` when the client left first.
    """
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(
            413, f"The request body is larger than {limit} bytes.", code="request_too_large"
        )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected", code="client_closed")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"The request body is larger than {limit} bytes.", code="request_too_large"
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_body(body: bytes, kind: str) -> dict[str, Any]:
    """The body of a request of ``kind``, parsed and checked: a JSON object
    with a ``model``; for ``chat``, ``completions`` and ``embeddings`` also
    their own fields (``messages``, ``prompt``, ``input``, ``stream``, ``n``,
    ``max_tokens``…). ``messages`` and ``responses`` bodies are checked by
    their translators. A ``stream`` of ``null`` is dropped.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    if not body:
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise bad_request("The request body must be a JSON object.")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model")
    if kind in ("messages", "responses"):
        return doc  # checked by their translators
    if kind == "chat":
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' is required and must be a non-empty array.", param="messages"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"messages[{i}] must be an object with a 'role'.", param=f"messages[{i}]"
                )
    elif kind == "completions":
        prompt = doc.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise bad_request(
                "'prompt' is required and must be a string or an array.", param="prompt"
            )
    else:
        given = doc.get("input")
        if not isinstance(given, str | list) or not given:
            raise bad_request(
                "'input' is required and must be a string or a non-empty array.", param="input"
            )
        if doc.get("stream"):
            raise bad_request("Embeddings are not streamed.", param="stream")
    if doc.get("stream") is None:
        doc.pop("stream", None)  # null means the default: not streamed
    elif not isinstance(doc["stream"], bool):
        raise bad_request("'stream' must be true or false.", param="stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    n = doc.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128):
        raise bad_request("'n' must be a whole number from 1 to 128.", param="n")
    for field in ("max_tokens", "max_completion_tokens"):
        value = doc.get(field)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise bad_request(f"'{field}' must be a positive integer.", param=field)
    return doc


def check_for_model(doc: dict[str, Any], model: ModelRecord, kind: str) -> None:
    """The checks that depend on the model: not stopped, ``max_tokens``
    within what it may answer, and nothing its engine cannot serve.

    Raises:
        ApiError: 503 ``model_stopped``, or 400 naming the field at fault
            as the client named it (Responses: ``max_output_tokens``).
    """
    if model.stopped:
        raise ApiError(
            503,
            f"The model '{model.name}' is stopped by an administrator.",
            type="server_error",
            code="model_stopped",
        )
    limit = model.max_output_tokens
    for field in ("max_tokens", "max_completion_tokens"):
        value = doc.get(field)
        if limit and isinstance(value, int) and value > limit:
            asked = "max_output_tokens" if kind == "responses" else field
            raise bad_request(
                f"'{asked}' is {value}, above the {limit} tokens '{model.name}' may answer.",
                param=asked,
            )
    profile = model.profile
    if model.external is None and profile is not None:
        refused = unsupported_request(profile.engine, profile.args, doc)
        if refused is not None:
            field, why = refused
            raise bad_request(f"'{model.name}' {why}.", param=field)


def estimate_tokens(doc: dict[str, Any], kind: str) -> int:
    """The tokens a request may spend: its prompt (:func:`estimate_prompt_tokens`)
    plus its ``max_tokens`` (none for embeddings). Charged to the token
    limiters first, then settled with the real count."""
    if kind == "embeddings":
        return estimate_prompt_tokens(doc, kind)
    output = doc.get("max_completion_tokens") or doc.get("max_tokens") or DEFAULT_MAX_OUTPUT_TOKENS
    return estimate_prompt_tokens(doc, kind) + int(output)


def estimate_prompt_tokens(doc: dict[str, Any], kind: str, *, bytes_per_token: int = 2) -> int:
    """A prompt's tokens from its size: one token per ``bytes_per_token``
    bytes of UTF-8 text, plus 4 a message for the chat template; at least 1.

    The default, 2, is on the high side (prose runs 4 or more bytes a
    token; repeated short words can run 2): what budgets and token limits
    hold before the real count is known, so a burst cannot overshoot by
    much. 4 is the typical figure, charged when an engine's count never
    came (an answer cut short)."""
    if kind == "chat":
        size = 0
        messages = doc.get("messages") or []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            size += (
                len(content.encode()) if isinstance(content, str) else len(orjson.dumps(content))
            )
        prompt = -(-size // bytes_per_token) + 4 * len(messages)
    else:
        given = doc.get("prompt") if kind == "completions" else doc.get("input")
        size = len(given.encode()) if isinstance(given, str) else len(orjson.dumps(given))
        prompt = -(-size // bytes_per_token)
    return max(prompt, 1)
