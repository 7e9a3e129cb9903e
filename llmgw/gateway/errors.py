"""Errors answered to clients: the one place where llmgw's errors take
OpenAI's or Anthropic's shape (``docs/api.md``).

OpenAI's shape, on every path but Anthropic's::

    {"error": {"message": ..., "type": ..., "code": ..., "param": ...}}

Anthropic's, on ``/v1/messages`` and every path below it
(``/v1/messages/count_tokens``, and an unknown one)::

    {"type": "error", "error": {"type": ..., "message": ...}}

Raise :class:`ApiError` (or any :class:`llmgw.errors.LlmgwError`) on the
request path; the gateway answers it through :func:`api_error` and
:func:`error_body_for` (by the request's kind) or :func:`error_body_on` (by
its path), with the status and headers :func:`api_error` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import orjson

from llmgw import errors

__all__ = [
    "ANTHROPIC_KINDS",
    "ANTHROPIC_PATH",
    "STORE_RETRY_AFTER_S",
    "ApiError",
    "anthropic_error_body",
    "anthropic_error_type",
    "api_error",
    "bad_request",
    "engine_error",
    "error_body",
    "error_body_for",
    "error_body_on",
    "internal_error",
    "is_anthropic_path",
    "shutting_down",
    "store_unavailable",
    "system_stopped",
    "unauthorized",
]

#: Seconds a client is told to wait when the store cannot be reached.
STORE_RETRY_AFTER_S: Final = 5
#: Anthropic's path: it and every path below it answer in Anthropic's shape.
ANTHROPIC_PATH: Final = "/v1/messages"
#: The request kinds answered in Anthropic's shape.
ANTHROPIC_KINDS: Final = frozenset({"messages", "count_tokens"})


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is :data:`ANTHROPIC_PATH` or below it."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class ApiError(errors.LlmgwError):
    """A request answered with an HTTP status and an error body: the client
    edge's own error, already in the shape it answers.

    Attributes:
        status: the HTTP status.
        message: what is wrong, said so the caller can fix it.
        type: OpenAI's error type (``invalid_request_error``, …).
        code: a short machine-readable code, or None.
        param: the request field at fault, or None.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = tuple(headers)

    def body(self) -> bytes:
        """OpenAI's error document for it, as JSON bytes."""
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def api_error(exc: errors.LlmgwError) -> ApiError:
    """The answer to ``exc``, as :class:`ApiError`:

    - an :class:`ApiError` as it is, less its traceback (the handler that
      answers it keeps it in a local, and a traceback holding that frame
      would make a reference cycle per error answered);
    - :class:`llmgw.errors.Refused` (a key refused, a limit or budget, the
      admission queue's wait, no replica ready): its ``status``, ``type``,
      ``code`` and message, with ``Retry-After`` (at least 1 s) when it
      gives ``retry_after_s``;
    - :class:`llmgw.errors.StoreError`: 503 ``store_unavailable``, ``Retry-After``
      :data:`STORE_RETRY_AFTER_S`;
    - :class:`llmgw.errors.UpstreamError`: 502 ``upstream_error``;
    - :class:`llmgw.errors.NotFound`: 404 ``not_found``;
    - :class:`llmgw.errors.InvalidInput`: 400 ``invalid_request``;
    - anything else: 500 ``internal_error``.
    """
    if isinstance(exc, ApiError):
        return exc.with_traceback(None)
    if isinstance(exc, errors.Refused):
        retry_after_s = exc.retry_after_s
        return ApiError(
            exc.status,
            str(exc),
            type=exc.type,
            code=exc.code,
            headers=(
                [(b"retry-after", str(max(1, round(retry_after_s))).encode())]
                if retry_after_s
                else ()
            ),
        )
    if isinstance(exc, errors.StoreError):
        return store_unavailable()
    if isinstance(exc, errors.UpstreamError):
        return ApiError(
            502, "The replica answering failed; retry.", type="server_error", code="upstream_error"
        )
    if isinstance(exc, errors.NotFound):
        return ApiError(404, str(exc), code="not_found")
    if isinstance(exc, errors.InvalidInput):
        return bad_request(str(exc))
    return internal_error()


def internal_error() -> ApiError:
    """500 ``internal_error``: a fault of the gateway's own (logged where it happened)."""
    return ApiError(500, "internal error", type="server_error", code="internal_error")


def engine_error(status: int, data: bytes) -> ApiError:
    """An engine's error answer (``status``, its body ``data``) in OpenAI's
    shape: ``code`` a string or null, ``type`` and ``param`` present, the
    engine's message kept when it gave one."""
    message, kind, code = f"The engine answered HTTP {status}.", None, None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        if isinstance(error.get("message"), str):
            message = error["message"]
        if isinstance(error.get("type"), str):
            kind = error["type"]
        if error.get("code") is not None:
            code = str(error["code"])
    elif isinstance(error, str):
        message = error
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code)


def error_body_for(error: ApiError, kind: str) -> bytes:
    """The body answering ``error`` on a route of ``kind`` (one of
    :data:`ANTHROPIC_KINDS`: Anthropic's shape; any other: OpenAI's)."""
    if kind in ANTHROPIC_KINDS:
        return anthropic_error_body(error.status, error.message)
    return error.body()


def error_body_on(path: str, error: ApiError) -> bytes:
    """The body answering ``error`` on ``path``: Anthropic's shape on
    :data:`ANTHROPIC_PATH` and below (:func:`is_anthropic_path`), else OpenAI's."""
    if is_anthropic_path(path):
        return anthropic_error_body(error.status, error.message)
    return error.body()


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """OpenAI's error document as JSON bytes."""
    return orjson.dumps({"error": {"message": message, "type": type, "code": code, "param": param}})


_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status: 400
    ``invalid_request_error``, 401 ``authentication_error``, 403
    ``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``,
    429 ``rate_limit_error``, 503 and 529 ``overloaded_error``, other 5xx
    ``api_error``, other 4xx ``invalid_request_error``."""
    kind = _ANTHROPIC_TYPES.get(status)
    if kind is not None:
        return kind
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error document, ``{"type": "error", "error": {"type",
    "message"}}``, as JSON bytes; the type follows :func:`anthropic_error_type`."""
    return orjson.dumps(
        {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    )


def unauthorized(message: str) -> ApiError:
    """401 ``invalid_api_key``: no key, or not one in the form asked."""
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400 ``invalid_request``, naming the field at fault as ``param``."""
    return ApiError(400, message, type="invalid_request_error", code="invalid_request", param=param)


def model_not_found(name: str) -> ApiError:
    """404 ``model_not_found``: no model or alias is called ``name``."""
    return ApiError(
        404, f"The model '{name}' does not exist", code="model_not_found", param="model"
    )


def shutting_down() -> ApiError:
    """503 ``server_shutting_down``, ``Retry-After: 1``: the gateway is
    stopping and its grace ran out before the request was answered."""
    return ApiError(
        503,
        "The gateway is stopping; the request was not answered. Retry.",
        type="server_error",
        code="server_shutting_down",
        headers=[(b"retry-after", b"1")],
    )


def system_stopped() -> ApiError:
    """503 ``system_stopped``: an administrator stopped serving (``llmgw stop``)."""
    return ApiError(
        503,
        "llmgw is stopped by an administrator; 'llmgw start' resumes serving.",
        type="server_error",
        code="system_stopped",
    )


def store_unavailable() -> ApiError:
    """503 ``store_unavailable``: a key or its limits cannot be read."""
    return ApiError(
        503,
        "The gateway cannot reach its store just now; retry shortly.",
        type="server_error",
        code="store_unavailable",
        headers=[(b"retry-after", str(STORE_RETRY_AFTER_S).encode())],
    )
