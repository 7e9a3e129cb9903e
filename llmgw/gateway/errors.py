"""Errors answered to clients, in OpenAI's shape on ``/v1``.

``{"error": {"message", "type", "code", "param"}}`` with the matching HTTP
status (``shared/spec/gateway-api.md``, Errors). Raise :class:`ApiError`
anywhere on the request path; the ASGI app turns it into the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

__all__ = ["ApiError", "error_body"]


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI error body.

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
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """OpenAI's error document as JSON bytes."""
    return orjson.dumps({"error": {"message": message, "type": type, "code": code, "param": param}})


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code="invalid_request", param=param)
