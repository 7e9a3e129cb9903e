"""The request-side checks the translators to OpenAI chat share
(:mod:`llmgw.gateway.anthropic`, :mod:`llmgw.gateway.responses`).

Sans-IO and pure. Each check raises :class:`~llmgw.gateway.errors.ApiError`
(400, naming the bad field as ``param``) through
:func:`~llmgw.gateway.errors.bad_request`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from .errors import bad_request

__all__ = [
    "chat_tool",
    "copy_sampling",
    "copy_stream",
    "is_int",
    "is_number",
    "request_model",
    "tool_objects",
]


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is an integer or a float (a bool is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def request_model(doc: Any) -> str:
    """The request's ``model``, once the body is a JSON object and it a non-empty string."""
    if not isinstance(doc, dict):
        raise bad_request("The request body must be a JSON object.")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", "model")
    return model


def copy_sampling(doc: dict[str, Any], chat: dict[str, Any]) -> None:
    """Copy ``temperature`` (0-2, the engines' range) and ``top_p`` (0-1) into ``chat``."""
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = doc.get(name)
        if value is None:
            continue
        if not is_number(value) or not 0 <= value <= high:
            raise bad_request(f"'{name}' must be a number from 0 to {high:g}.", name)
        chat[name] = value


def copy_stream(doc: dict[str, Any], chat: dict[str, Any]) -> None:
    """Copy ``stream: true`` into ``chat``, asking the engine for usage in the stream."""
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}


def tool_objects(tools: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """The request's ``tools`` (a list of objects; None: none), each with its
    path, checked one by one as they are taken."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", "tools")
    for index, tool in enumerate(tools):
        at = f"tools.{index}"
        if not isinstance(tool, dict):
            raise bad_request(f"'{at}' must be an object.", at)
        yield at, tool


def chat_tool(
    tool: dict[str, Any], at: str, schema_field: str, *, default: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A chat ``function`` tool from ``tool``'s ``name``, ``description``,
    JSON schema (in ``schema_field``; ``default`` when absent, required when
    that is None) and ``strict``."""
    name, description = tool.get("name"), tool.get("description")
    schema = tool.get(schema_field)
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{at}.name' must be a non-empty string.", f"{at}.name")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{at}.description' must be a string.", f"{at}.description")
    if schema is None and default is not None:
        schema = dict(default)
    if not isinstance(schema, dict):
        raise bad_request(f"'{at}.{schema_field}' must be an object.", f"{at}.{schema_field}")
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = schema
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}
