"""The admin API's errors: the one shape every error answer has, and the one
place that maps :mod:`llmgw.errors` onto it.

Every error answer is JSON::

    {"error": {"message": str, "type": str, "code": str | null, "param": str | null}}

``type`` is ``invalid_request_error`` below status 500 and ``server_error``
from 500 on. A route raises an error of the tree (or one of the leaves
below, which add a ``code`` or a ``param``); :func:`answer_for` turns it into
a status and that body:

====================================  ======  ====================================
error                                 status  code (message)
====================================  ======  ====================================
``settings.SettingsError``            400     ``invalid_settings`` ("Settings not valid: …")
``control.catalog.CatalogError``      400     ``invalid_model``
other ``InvalidInput``                400     its ``code``, else null
``NotFound``                          404     its ``code``, else ``not_found``
``store.Conflict``                    409     ``conflict`` ("…; read it again and retry.")
``store.Fenced``                      503     ``not_leader`` (a deposed leader's write, refused
                                              by the store; nothing written)
``Refused``                           its     its ``code``
                                      status
``StoreError``                        503     ``store_unavailable`` ("The store cannot be reached: …")
``UpstreamError``                     504     null (a node did not answer in time)
any other ``LlmgwError``              500     null
====================================  ======  ====================================

``param`` is the error's ``param`` attribute when it has one. Anything that
is not an ``LlmgwError`` is a bug: 500 ``internal_error``, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Final

import orjson
from quart import Response, request
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.control.catalog import CatalogError
from llmgw.settings import SettingsError
from llmgw.store import Conflict, Fenced

__all__ = [
    "BadRequest",
    "Clash",
    "NoSuch",
    "NotLeader",
    "answer_for",
    "error_response",
    "install",
    "known_names",
]

log = logging.getLogger("llmgw.admin")

_JSON: Final = "application/json"
#: The most names an "unknown …" answer lists.
MAX_NAMES_LISTED: Final = 20


def known_names(what: str, names: Iterable[str], *, hint: str = "") -> str:
    """``the WHAT are: a, b, c`` (sorted; at most :data:`MAX_NAMES_LISTED`,
    then ``and N more``, with ``hint`` saying where the rest are), or
    ``there are no WHAT``: the end of an "unknown …" message."""
    ordered = sorted(set(names))
    if not ordered:
        return f"there are no {what}"
    shown = ", ".join(ordered[:MAX_NAMES_LISTED])
    if len(ordered) > MAX_NAMES_LISTED:
        shown += f" and {len(ordered) - MAX_NAMES_LISTED} more" + (f" ({hint})" if hint else "")
    return f"the {what} are: {shown}"


class NotLeader(errors.Refused):
    """An admin change sent to a control plane that does not lead (503
    ``not_leader``): changes are made on the leader (``docs/ha.md``)."""

    status = 503
    code = "not_leader"
    type = "server_error"


class BadRequest(errors.InvalidInput):
    """A request the route cannot take (400): a missing or malformed field.

    Attributes:
        code: the answer's ``code``, or ``None``.
        param: the request field at fault, or ``None``.
    """

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class NoSuch(errors.NotFound):
    """The thing a route names does not exist (404).

    Attributes:
        code: the answer's ``code`` (``model_not_found``, …).
        param: the request field naming it, or ``None``.
    """

    def __init__(self, message: str, *, code: str = "not_found", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class Clash(errors.Refused):
    """The change clashes with what is there (409): a name taken, a key
    already revoked."""

    status = 409

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def answer_for(exc: errors.LlmgwError) -> tuple[int, dict[str, str | None]]:
    """The status and the ``error`` object of the answer to ``exc`` (see the
    module docstring)."""
    message = str(exc)
    code: str | None = None
    if isinstance(exc, SettingsError):
        status, code, message = 400, "invalid_settings", f"Settings not valid: {exc}"
    elif isinstance(exc, CatalogError):
        status, code = 400, "invalid_model"
    elif isinstance(exc, errors.InvalidInput):
        status = 400
    elif isinstance(exc, errors.NotFound):
        status, code = 404, "not_found"
    elif isinstance(exc, Conflict):
        status, code, message = 409, "conflict", f"{exc}; read it again and retry."
    elif isinstance(exc, errors.Refused):
        status, code = exc.status, exc.code
    elif isinstance(exc, Fenced):
        status, code = 503, "not_leader"
        holder = "" if exc.current is None else f" ({exc.current[0]} holds it now)"
        message = (
            f"This control plane no longer leads: the leader lease moved on{holder}, so the "
            "store wrote nothing. Make the change on the leader (the one answering /leader)."
        )
    elif isinstance(exc, errors.StoreError):
        log.warning("admin API: store error: %s", exc)
        status, code = 503, "store_unavailable"
        message = f"The store cannot be reached: {exc}"
    elif isinstance(exc, errors.UpstreamError):
        status = 504
    else:
        status = 500
    code = getattr(exc, "code", code)
    param = getattr(exc, "param", None)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"message": message, "type": kind, "code": code, "param": param}


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> Response:
    """An error answer of the module docstring's shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _response(status, {"message": message, "type": kind, "code": code, "param": param})


def _response(status: int, error: dict[str, str | None]) -> Response:
    return Response(orjson.dumps({"error": error}), status=status, content_type=_JSON)


def install(app: QuartTrio) -> None:
    """Answer ``app``'s errors in the one shape: tree errors by
    :func:`answer_for`, and quart's own 404, 405 and 500."""

    @app.errorhandler(errors.LlmgwError)
    async def tree_error(exc: errors.LlmgwError) -> Response:
        return _response(*answer_for(exc))

    @app.errorhandler(404)
    async def not_found(_: Exception) -> Response:
        return error_response(404, f"No route {request.method} {request.path}.", "unknown_url")

    @app.errorhandler(405)
    async def wrong_method(exc: Exception) -> Response:
        response = error_response(
            405, f"{request.path} does not take {request.method}.", "method_not_allowed"
        )
        # RFC 9110 section 15.5.6: a 405 names the methods the route takes.
        allowed = getattr(exc, "valid_methods", None)
        if allowed:
            response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    @app.errorhandler(500)
    async def internal(_: Exception) -> Response:
        return error_response(
            500, "Internal error; the control plane's log says more.", "internal_error"
        )
