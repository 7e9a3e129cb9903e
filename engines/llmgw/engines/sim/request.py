"""Reading a request to the sim engine: its body, and the fields every route
checks; a bad one raises :class:`RequestError`, which the app answers in
OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import orjson

from llmgw.asgi import Receive
from llmgw.errors import InvalidInput

__all__ = [
    "MAX_BODY_BYTES",
    "RequestError",
    "bounded_int",
    "chat_text",
    "embedding_inputs",
    "flag",
    "include_usage",
    "json_object",
    "max_tokens",
    "prompt_text",
    "read_body",
    "stop_strings",
]

#: The largest request body read, in bytes; larger ones get 413.
MAX_BODY_BYTES = 32 * 1024 * 1024


class RequestError(InvalidInput):
    """A request the sim engine refuses.

    Attributes:
        status: the HTTP status to answer (400, or 413 for a body too large).
        message: OpenAI's error ``message``.
        kind: OpenAI's error ``type``.
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client went away.

    Raises:
        RequestError: 413, the body is over :data:`MAX_BODY_BYTES`.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` parsed; raises :class:`RequestError` unless it is a JSON object."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise RequestError(400, f"the body is not JSON: {error}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "the body must be a JSON object")
    return doc


def flag(doc: dict[str, Any], name: str) -> bool:
    """The boolean field ``name`` (absent or null: False)."""
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be a boolean")
    return value


def max_tokens(doc: dict[str, Any], *names: str) -> int | None:
    """The first of the fields ``names`` that is given (a token count), or None."""
    for name in names:
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError(400, f"'{name}' must be a non-negative integer")
        return value
    return None


def include_usage(doc: dict[str, Any]) -> bool:
    """``stream_options.include_usage``."""
    options = doc.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object")
    return flag(options, "include_usage")


def bounded_int(doc: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """The integer field ``name``, from ``low`` to ``high``; ``default`` when absent."""
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(400, f"'{name}' must be an integer from {low} to {high}")
    return value


def stop_strings(value: Any) -> list[str]:
    """The non-empty strings of a ``stop`` field (a string or a list of them)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(400, "'stop' must be a string or a list of strings")
    return [s for s in value if s]


def _content_text(content: Any) -> str:
    """The text of a chat message's ``content``: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        return " ".join(texts)
    raise RequestError(400, "a message's 'content' must be a string or a list of parts")


def chat_text(doc: dict[str, Any]) -> str:
    """The text of a chat request's ``messages``, one line per message
    (the text parts of each); raises :class:`RequestError` unless
    ``messages`` is a non-empty list of objects."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list")
    texts = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError(400, "each message must be an object")
        texts.append(_content_text(message.get("content")))
    return "\n".join(texts)


def prompt_text(doc: dict[str, Any]) -> str:
    """The text of a completions ``prompt``: one string or token list."""
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return " ".join(str(t) for t in prompt)
    raise RequestError(400, "'prompt' must be one string or one list of token ids")


def embedding_inputs(doc: dict[str, Any]) -> list[bytes]:
    """The bytes of each embeddings ``input``: a string's UTF-8, or a token
    id list's JSON."""
    value = doc.get("input")
    if isinstance(value, str):
        return [value.encode()]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [item.encode() for item in value]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [orjson.dumps(value)]
        if all(isinstance(item, list) for item in value):
            return [orjson.dumps(item) for item in value]
    raise RequestError(400, "'input' must be a string, strings, or token id lists")
