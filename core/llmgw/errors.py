"""Every error llmgw raises on purpose, as one tree.

Each member's own errors derive from one of these classes, so a caller can
catch a whole family (``except llmgw.errors.LinkError``) without importing
the member that raised it, and each edge maps the tree to its own shape in
one place: the client API to OpenAI's or Anthropic's error body
(``llmgw.gateway.errors``), the admin API to ``{"error": {...}}``
(``llmgw.admin``), the CLI to a message and exit code 1, and the agent link
to an ``Error`` frame.

The tree::

    LlmgwError
    ├── InvalidInput           (also ValueError) input that breaks a rule: a
    │   │                      setting, a catalog entry, a model file, a frame
    │   ├── control.ca.BadCertificateRequest
    │   ├── settings.SettingsError
    │   ├── control.catalog.CatalogError
    │   └── control.planning.PlanningError
    ├── NotFound               a named thing (model, node, key, request) is absent
    ├── Refused                a request refused by policy; carries an HTTP status
    │   ├── auth.keys.KeyRefused
    │   ├── accounting.accountant.ModelNotAllowed, RateLimited, BudgetSpent
    │   ├── router.admission.AdmissionTimeout
    │   └── store.JoinTokenRefused  a join code that cannot be used (403/410)
    │       └── JoinTokenUnknown, JoinTokenUsed, JoinTokenExpired
    ├── UpstreamError          an engine or outside provider failed or timed out
    ├── StoreError             the store refused or failed
    │   └── store.Conflict
    ├── LinkError              the agent link failed
    │   ├── LinkClosed         the peer went away or the socket broke
    │   └── ProtocolError      a frame that breaks the wire protocol
    │       ├── FrameTooLarge, UnknownMessage, BadFrame
    │       └── VersionMismatch
    ├── AgentError             a node agent cannot do what it was asked
    │   ├── StateDirBusy, WeightsMismatch, BandwidthError
    └── StartupError           a process cannot start (a port taken, a bad
                               data directory, a model that will not load)

``LlmgwError``, the families under it and the link's two (``LinkClosed``,
``ProtocolError``, raised by both ends) live here; the leaves live beside the
code that raises them. The client API's own ``gateway.errors.ApiError``, an
error already in the client's shape, derives from ``LlmgwError`` itself.

:func:`describe` is the text of any exception for a log line or a message:
never empty (an exception raised without text, such as a timeout, reads as
its class and what that class means).
"""

from __future__ import annotations

import re

__all__ = [
    "AgentError",
    "InvalidInput",
    "LinkClosed",
    "LinkError",
    "LlmgwError",
    "NotFound",
    "ProtocolError",
    "Refused",
    "StartupError",
    "StoreError",
    "UpstreamError",
    "describe",
]

#: The base classes whose docstrings say nothing about one failure.
_GENERIC_BASES = (BaseException, Exception, OSError)
#: reStructuredText roles in a docstring (``:func:`fail_after```).
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def describe(exc: BaseException) -> str:
    """The text of ``exc`` for a log line or an error message, never empty.

    ``str(exc)`` when it says something; otherwise its class name and what
    it means: the description of its cause (``raise X from cause``) when
    there is one, else the first paragraph of the nearest docstring on its
    class's ancestry (``TooSlowError (raised by fail_after … if the timeout
    expires)``), else ``(no details given)``.
    """
    text = str(exc).strip()
    if text:
        return text
    name = type(exc).__name__
    cause = exc.__cause__
    if cause is None and not exc.__suppress_context__:
        cause = exc.__context__
    if cause is not None and cause is not exc:
        return f"{name}: {describe(cause)}"
    return f"{name} ({_meaning(type(exc))})"


def _meaning(cls: type[BaseException]) -> str:
    for klass in cls.__mro__:
        if klass in _GENERIC_BASES or klass is object:
            break
        doc = klass.__dict__.get("__doc__")
        if isinstance(doc, str) and doc.strip():
            paragraph = " ".join(doc.strip().split("\n\n")[0].split())
            line = _ROLE.sub(r"\1", paragraph).rstrip(".")
            if line:
                return line[0].lower() + line[1:]
    return "no details given"


class LlmgwError(Exception):
    """The root of every error llmgw raises on purpose."""


class InvalidInput(LlmgwError, ValueError):
    """Input that breaks a rule; the message names what and where."""


class NotFound(LlmgwError, LookupError):
    """A named thing (a model, node, key, request) does not exist."""


class Refused(LlmgwError):
    """A request refused by policy.

    Attributes (class defaults, which subclasses or instances override):
        status: the HTTP status an edge answers with (403, 429, 504, …).
        code: OpenAI's error ``code`` (``rate_limit_exceeded``, …).
        type: OpenAI's error ``type``.
        retry_after_s: whole seconds for ``Retry-After``, or ``None``.
    """

    status: int = 403
    code: str = "refused"
    type: str = "invalid_request_error"
    retry_after_s: int | None = None


class UpstreamError(LlmgwError):
    """An engine or an outside provider failed, refused or timed out."""


class StoreError(LlmgwError):
    """The store refused an operation or could not be reached."""


class LinkError(LlmgwError):
    """The link between an agent and a control plane failed."""


class LinkClosed(LinkError):
    """The peer closed the link or the connection broke."""


class ProtocolError(LinkError):
    """A frame that breaks the agent protocol (size, shape, version)."""


class AgentError(LlmgwError):
    """A node agent cannot do what it was asked."""


class StartupError(LlmgwError):
    """A process cannot start: a port taken, a bad data directory, a model
    that does not load."""
