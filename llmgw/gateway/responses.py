"""OpenAI's Responses API (``POST /v1/responses``) over engines that speak
chat completions (``docs/api.md``).

Stateless: no response is stored, so ``previous_response_id`` is refused
and every request carries its whole conversation in ``input``.

- :func:`request_to_chat` checks a Responses request and turns it into a
  chat request (raising :class:`~llmgw.gateway.errors.ApiError`; error
  bodies on this route use OpenAI's shape, :mod:`llmgw.gateway.errors`);
- :func:`chat_to_response` turns a ``chat.completion`` into a ``response``;
- :class:`ResponsesStream` turns the engine's chat SSE bytes into the
  Responses streaming events as they arrive.

Usage follows the Responses shape: ``input_tokens`` = the engine's
``prompt_tokens`` (cached tokens inside, as in chat, and repeated in
``input_tokens_details.cached_tokens``; ``cache_write_tokens`` is 0,
engines do not report it), ``output_tokens`` =
``completion_tokens`` (reasoning included; ``reasoning_tokens`` is reported
as 0, engines do not split it), ``total_tokens`` their sum.

The engine's reasoning text (``reasoning_content`` or ``reasoning``)
becomes a leading ``reasoning`` output item with ``reasoning_text``
content. Reasoning items sent back in ``input`` are dropped.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

import orjson

from .chat_stream import ChatStreamTranslator, TextKind, answer_choice, reasoning_text
from .errors import bad_request
from .sse import Usage, usage_from
from .translate import (
    chat_tool,
    copy_sampling,
    copy_stream,
    is_int,
    request_model,
    tool_objects,
)

__all__ = [
    "ResponsesStream",
    "chat_to_response",
    "new_response_id",
    "request_to_chat",
    "response_usage",
]

_ROLES: Final = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}
_TOOL_CHOICES: Final = ("auto", "none", "required")
#: A function tool's ``parameters`` when the request gives none.
_NO_PARAMETERS: Final = {"type": "object"}


def new_response_id() -> str:
    """A fresh response id, ``resp_`` and 24 hex digits."""
    return _new_id("resp")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- the request ------------------------------------------------------------------------


def request_to_chat(doc: dict[str, Any]) -> dict[str, Any]:
    """Check a Responses request and translate it to OpenAI chat.

    Understood fields: ``model``; ``input`` (a string, or a list of items:
    messages ``{role: user|assistant|system|developer, content: string |
    [{type: input_text|output_text|refusal, text} | {type: input_image,
    image_url}]}`` (``developer`` → ``system``), ``function_call`` items
    (→ the assistant's ``tool_calls``), ``function_call_output`` items (→
    ``role: tool`` messages), ``reasoning`` items (dropped));
    ``instructions`` → a leading system message; ``max_output_tokens`` →
    ``max_tokens``; ``temperature``; ``top_p``; ``tools`` of type
    ``function`` → chat tools; ``tool_choice``; ``parallel_tool_calls``;
    ``text.format`` (``json_object``/``json_schema`` → ``response_format``);
    ``user``; ``stream`` (adds ``stream_options.include_usage``). ``store``,
    ``metadata``, ``reasoning``, ``truncation``, ``include`` and other
    fields are ignored.

    Returns:
        A new chat request document.

    Raises:
        ApiError: 400 naming the bad field as ``param`` (e.g.
            ``input.3.content.0.type``); ``previous_response_id`` is refused
            (nothing is stored), as are tools other than functions.
    """
    model = request_model(doc)
    if doc.get("previous_response_id") is not None:
        raise bad_request(
            "'previous_response_id' is not supported: responses are not stored; "
            "send the whole conversation in 'input'.",
            "previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    instructions = doc.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string.", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = doc.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for index, item in enumerate(items):
            _item(item, f"input.{index}", messages)
    else:
        raise bad_request("'input' must be a string or a non-empty list of items.", "input")
    if not messages:
        raise bad_request("'input' holds no message to answer.", "input")

    chat: dict[str, Any] = {"model": model, "messages": messages}
    max_tokens = doc.get("max_output_tokens")
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise bad_request("'max_output_tokens' must be an integer ≥ 1.", "max_output_tokens")
        chat["max_tokens"] = max_tokens
    copy_sampling(doc, chat)
    copy_stream(doc, chat)
    tools = _tools(doc.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = doc.get("tool_choice")
        if choice is not None:
            chat["tool_choice"] = _tool_choice(choice)
        parallel = doc.get("parallel_tool_calls")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise bad_request("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
            chat["parallel_tool_calls"] = parallel
    response_format = _response_format(doc.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    user = doc.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise bad_request("'user' must be a string.", "user")
        chat["user"] = user
    return chat


def _text_field(part: dict[str, Any], name: str, where: str) -> str:
    text = part.get(name)
    if not isinstance(text, str):
        raise bad_request(f"'{where}.{name}' must be a string.", f"{where}.{name}")
    return text


def _parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.{index}"
        if not isinstance(part, dict):
            raise bad_request(f"'{at}' must be an object.", at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _text_field(part, "text", at)})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _text_field(part, "refusal", at)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request(
                    f"'{at}.image_url' must be a URL or data URL (file ids are not supported).",
                    f"{at}.image_url",
                )
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise bad_request(
                f"'{at}': content parts of type {kind!r} are not supported.", f"{at}.type"
            )
    return parts


def _content(content: Any, where: str, *, text_only: bool) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of parts.", where)
    parts = _parts(content, where)
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    if text_only:
        raise bad_request(f"'{where}': only text is supported here.", where)
    return parts


def _item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object.", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(
                f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer'.",
                f"{where}.role",
            )
        chat_role = _ROLES[role]
        content = _content(item.get("content"), f"{where}.content", text_only=chat_role != "user")
        messages.append({"role": chat_role, "content": content})
    elif kind == "function_call":
        call_id, name = item.get("call_id"), item.get("name")
        arguments = item.get("arguments", "")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"'{where}.call_id' must be a non-empty string.", f"{where}.call_id")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{where}.name' must be a non-empty string.", f"{where}.name")
        if not isinstance(arguments, str):
            raise bad_request(f"'{where}.arguments' must be a string.", f"{where}.arguments")
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"'{where}.call_id' must be a non-empty string.", f"{where}.call_id")
        output = _content(item.get("output", ""), f"{where}.output", text_only=True)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        return
    else:
        raise bad_request(
            f"'{where}': input items of type {kind!r} are not supported.", f"{where}.type"
        )


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for at, tool in tool_objects(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"'{at}': tools of type {tool.get('type')!r} are not supported; only 'function'.",
                f"{at}.type",
            )
        out.append(chat_tool(tool, at, "parameters", default=_NO_PARAMETERS))
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'tool_choice.name' must be a non-empty string.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise bad_request(
        "'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', name}.",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object.", "text")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(spec, dict)
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("'text.format.schema' must be an object.", "text.format.schema")
        name = spec.get("name")
        json_schema: dict[str, Any] = {
            "name": name if isinstance(name, str) and name else "response",
            "schema": schema,
        }
        if isinstance(spec.get("strict"), bool):
            json_schema["strict"] = spec["strict"]
        return {"type": "json_schema", "json_schema": json_schema}
    raise bad_request(
        "'text.format.type' must be 'text', 'json_object' or 'json_schema'.", "text.format.type"
    )


# -- the answer -------------------------------------------------------------------------


def response_usage(usage: Usage | None) -> dict[str, Any] | None:
    """A Responses ``usage`` document from the engine's OpenAI usage (None stays None)."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _status(finish_reason: Any) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _skeleton(
    response_id: str, model: str, created_at: int, request: dict[str, Any] | None
) -> dict[str, Any]:
    """The response document without output, status and usage; echoes the
    request's settings as OpenAI does."""
    req = request or {}
    tools = req.get("tools")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "temperature": req.get("temperature"),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": tools if isinstance(tools, list) else [],
        "top_p": req.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": req.get("user"),
        "metadata": req.get("metadata") or {},
    }


def _reasoning_item(text: str, item_id: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [_text_part("reasoning", text)],
        "status": status,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_part(kind: str, text: str) -> dict[str, Any]:
    """The content part of a ``reasoning`` or ``message`` item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return _output_text(text)


def _text_events(kind: str) -> tuple[str, dict[str, Any]]:
    """The stem of a ``reasoning`` or ``message`` item's text events
    (``….delta``, ``….done``) and what else they carry."""
    if kind == "reasoning":
        return "response.reasoning_text", {}
    return "response.output_text", {"logprobs": []}


def _message_item(text: str | None, item_id: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_output_text(text)],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def chat_to_response(
    chat: dict[str, Any],
    model: str,
    *,
    response_id: str | None = None,
    request: dict[str, Any] | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """Translate an OpenAI ``chat.completion`` into a Responses ``response``.

    Reads the first choice. ``output``: a ``reasoning`` item when the engine
    reasoned; a ``message`` item with one ``output_text`` part (when there
    is text, or nothing else); a ``function_call`` item per tool call
    (``call_id`` the engine's call id, ``arguments`` its JSON text as is).
    ``status``: ``completed``, or ``incomplete`` with ``incomplete_details.
    reason`` ``max_output_tokens`` (finish ``length``) or ``content_filter``.
    ``usage``: see the module doc (None when the engine sent none).

    Args:
        chat: the engine's answer (anything malformed counts as empty).
        model: the model name to report.
        response_id: the id; a new ``resp_…`` when None.
        request: the client's Responses request, whose settings (tools,
            tool_choice, temperature, instructions, …) are echoed.
        created_at: Unix seconds; the engine's ``created`` or now when None.
    """
    choice, message = answer_choice(chat)
    status, details = _status(choice.get("finish_reason"))
    item_status = "incomplete" if status == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    listed = message.get("tool_calls")
    # An engine's answer is outside input: anything but a list holds no calls.
    calls = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
    text = message.get("content")
    if reasoning:
        # Reasoning cut short only when nothing came after it.
        done = bool(calls) or (isinstance(text, str) and bool(text))
        output.append(
            _reasoning_item(reasoning, _new_id("rs"), "completed" if done else item_status)
        )
    if (isinstance(text, str) and text) or not calls:
        output.append(
            _message_item(text if isinstance(text, str) else "", _new_id("msg"), item_status)
        )
    for call in calls:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        output.append(
            _call_item(
                _new_id("fc"),
                call_id if isinstance(call_id, str) and call_id else _new_id("call"),
                name if isinstance(name, str) else "",
                arguments if isinstance(arguments, str) else "",
                "completed",
            )
        )
    if created_at is None:
        created = chat.get("created")
        created_at = created if is_int(created) else int(time.time())
    doc = _skeleton(response_id or new_response_id(), model, created_at, request)
    doc.update(
        status=status,
        incomplete_details=details,
        output=output,
        usage=response_usage(usage_from(chat)),
    )
    return doc


# -- streaming --------------------------------------------------------------------------


class _Item:
    """One output item being streamed."""

    __slots__ = ("call_id", "id", "kind", "name", "output_index", "status", "text")

    def __init__(self, kind: str, item_id: str, output_index: int) -> None:
        self.kind = kind  # "reasoning", "message" or "function_call"
        self.id = item_id
        self.output_index = output_index
        self.text = ""  # the text, reasoning or arguments so far
        self.call_id = ""
        self.name = ""
        self.status = "in_progress"

    def doc(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return _reasoning_item(self.text, self.id, status)
        if self.kind == "message":
            return _message_item(self.text, self.id, status)
        return _call_item(self.id, self.call_id, self.name, self.text, status)


class ResponsesStream(ChatStreamTranslator[_Item]):
    """Translates an engine's OpenAI chat stream into Responses events.

    Sans-IO (see :class:`~llmgw.gateway.chat_stream.ChatStreamTranslator`,
    whose attributes it has): :meth:`feed` takes the engine's SSE bytes
    (cut anywhere) and returns SSE bytes (``event: <type>\\ndata:
    {json}\\n\\n``, each event with its ``sequence_number`` from 0), every
    event in hand joined:

    ``response.created``, ``response.in_progress`` (:meth:`start`); per
    output item ``response.output_item.added``, then for a message
    ``response.content_part.added``, ``response.output_text.delta``…,
    ``response.output_text.done``, ``response.content_part.done``; for
    reasoning the same with ``response.reasoning_text.delta``/``.done``; for
    a function call ``response.function_call_arguments.delta``…/``.done``;
    then ``response.output_item.done``. At ``[DONE]`` (or :meth:`finish`):
    open items are closed and ``response.completed`` (or
    ``response.incomplete`` when the engine stopped at
    ``length``/``content_filter``) carries the whole response with its
    usage; a stream the engine broke off still ends with
    ``response.completed``. An error the engine sends mid-stream ends it
    with ``response.failed``. Only choice 0 is read.

    Args:
        model: the model name to report.
        response_id: the id (:func:`new_response_id`).
        request: the client's request, whose settings are echoed.
        created_at: Unix seconds; now when None.
    """

    def __init__(
        self,
        model: str,
        response_id: str,
        *,
        request: dict[str, Any] | None = None,
        created_at: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.response_id = response_id
        when = int(time.time()) if created_at is None else created_at
        self._response = _skeleton(response_id, model, when, request)
        self._sequence = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None

    def error_event(self, message: str, code: str = "server_error") -> bytes:
        """``response.failed`` with ``error {code, message}`` and the output
        so far; marks the stream done (``b""`` if it already was)."""
        if self.done:
            return b""
        out = [self.start()]
        self.done = True
        response = {
            **self._response,
            "status": "failed",
            "error": {"code": code, "message": message},
            "output": [item.doc("incomplete") for item in self._items],
            "usage": self._usage(),
        }
        self._emit(out, "response.failed", response=response)
        return b"".join(out)

    # -- internals

    def _emit(self, out: list[bytes], kind: str, **fields: Any) -> None:
        doc = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n")

    def _usage(self) -> dict[str, Any] | None:
        if self.usage is not None:
            return response_usage(self.usage)
        return response_usage(Usage(completion_tokens=self.content_chunks))

    def _start_events(self, out: list[bytes]) -> None:
        for kind in ("response.created", "response.in_progress"):
            self._emit(out, kind, response=self._response)

    def _engine_failed(self, message: str) -> bytes:
        return self.error_event(message)

    def _add(self, kind: str, prefix: str, out: list[bytes]) -> _Item:
        self._close(out, "completed")
        item = _Item(kind, _new_id(prefix), len(self._items))
        self._items.append(item)
        self._open = item
        return item

    def _text(self, kind: TextKind, text: str, out: list[bytes]) -> None:
        item_kind = "reasoning" if kind == "reasoning" else "message"
        item = self._open
        if item is None or item.kind != item_kind:
            item = self._add(item_kind, "rs" if kind == "reasoning" else "msg", out)
            added = {**item.doc("in_progress"), "content": []}
            self._emit(
                out, "response.output_item.added", output_index=item.output_index, item=added
            )
            self._emit(
                out,
                "response.content_part.added",
                item_id=item.id,
                output_index=item.output_index,
                content_index=0,
                part=_text_part(item_kind, ""),
            )
        item.text += text
        stem, extra = _text_events(item_kind)
        self._emit(
            out,
            f"{stem}.delta",
            item_id=item.id,
            output_index=item.output_index,
            content_index=0,
            delta=text,
            **extra,
        )

    def _new_call_id(self) -> str:
        return _new_id("call")

    def _call_start(self, call_id: str, name: str, out: list[bytes]) -> _Item:
        item = self._add("function_call", "fc", out)
        item.call_id, item.name = call_id, name
        self._emit(
            out,
            "response.output_item.added",
            output_index=item.output_index,
            item=item.doc("in_progress"),
        )
        return item

    def _call_arguments(self, call: _Item, arguments: str, out: list[bytes]) -> None:
        call.text += arguments
        self._emit(
            out,
            "response.function_call_arguments.delta",
            item_id=call.id,
            output_index=call.output_index,
            delta=arguments,
        )

    def _close(self, out: list[bytes], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        common = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "function_call":
            self._emit(
                out,
                "response.function_call_arguments.done",
                **common,
                name=item.name,
                arguments=item.text,
            )
        else:
            stem, extra = _text_events(item.kind)
            self._emit(out, f"{stem}.done", **common, content_index=0, text=item.text, **extra)
            self._emit(
                out,
                "response.content_part.done",
                **common,
                content_index=0,
                part=_text_part(item.kind, item.text),
            )
        self._emit(
            out,
            "response.output_item.done",
            output_index=item.output_index,
            item=item.doc(status),
        )

    def _end(self, out: list[bytes]) -> None:
        status, details = _status(self.finish_reason)
        item_status = "incomplete" if status == "incomplete" else "completed"
        self._close(out, item_status)
        response = {
            **self._response,
            "status": status,
            "incomplete_details": details,
            "output": [item.doc(item.status) for item in self._items],
            "usage": self._usage(),
        }
        kind = "response.completed" if status == "completed" else "response.incomplete"
        self._emit(out, kind, response=response)
