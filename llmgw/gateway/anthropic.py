"""Anthropic's Messages API (``POST /v1/messages``) over engines that speak
OpenAI chat completions (``docs/api.md``, Anthropic surface).

Sans-IO and pure: nothing here reads a socket or a clock.

- :func:`request_to_chat` checks an Anthropic request and turns it into an
  OpenAI chat request (raising :class:`~llmgw.gateway.errors.ApiError` on
  bad input);
- :func:`chat_to_message` turns an OpenAI ``chat.completion`` into an
  Anthropic ``message``;
- :class:`MessagesStream` turns the engine's OpenAI SSE bytes into
  Anthropic's event sequence as they arrive;
- :func:`error_event` ends a broken stream in Anthropic's shape (the error
  bodies are :mod:`llmgw.gateway.errors`'s).

Usage: OpenAI counts cached prompt tokens *inside* ``prompt_tokens``;
Anthropic reports cache reads *outside* ``input_tokens``. So an answer says
``input_tokens = prompt_tokens - cached_tokens``, ``cache_read_input_tokens =
cached_tokens`` and ``output_tokens = completion_tokens`` (reasoning
included); the engine's own :class:`~llmgw.gateway.sse.Usage` stays
available (:attr:`MessagesStream.usage`) for accounting, so nothing is
counted twice.

The engine's reasoning text (``reasoning_content``, as llama.cpp and vLLM
send it, or ``reasoning``) becomes ``thinking`` blocks with an empty
``signature``. Thinking blocks sent back in a request are dropped: engines
cannot check or take them.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

import orjson

from .chat_stream import (
    DONE,
    ChatChunkReader,
    ChatStreamTranslator,
    TextKind,
    answer_choice,
    engine_error,
    first_choice,
    reasoning_text,
)
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
    "DONE",
    "ChatChunkReader",
    "MessagesStream",
    "chat_to_message",
    "engine_error",
    "error_event",
    "first_choice",
    "new_message_id",
    "request_to_chat",
    "stop_reason",
    "tool_input",
]

_CHAT_TOOL_CHOICE: Final = {"auto": "auto", "any": "required", "none": "none"}


def new_message_id() -> str:
    """A fresh Anthropic-style message id, ``msg_`` and 24 hex digits."""
    return f"msg_{secrets.token_hex(12)}"


# -- the request ------------------------------------------------------------------------


def request_to_chat(doc: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """Check an Anthropic Messages request and translate it to OpenAI chat.

    With ``counting`` it is a ``count_tokens`` body: ``max_tokens`` may be
    left out (the chat request then has none).

    Understood fields: ``model``, ``max_tokens`` (int ≥ 1), ``messages``
    (``user``/``assistant``; content a string or blocks ``text``, ``image``
    (base64 or url source → ``image_url``), ``document`` (plain-text source
    only), ``tool_use``, ``tool_result``, ``thinking``/``redacted_thinking``
    (dropped)), ``system`` (string or text blocks → a leading system
    message), ``stop_sequences`` → ``stop``, ``temperature`` (0-2, the
    engines' range; Anthropic's is 0-1), ``top_p``, ``top_k``, ``stream`` (adds ``stream_options.include_usage``), ``tools``
    (custom tools → ``function`` tools), ``tool_choice`` (``auto``/``any``/
    ``tool``/``none`` → ``auto``/``required``/named/``none``;
    ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``),
    ``metadata.user_id`` → ``user``. ``thinking``, ``cache_control`` and
    other fields are ignored.

    An assistant's ``tool_use`` blocks become its ``tool_calls`` (arguments
    as a JSON string); a user's ``tool_result`` blocks become ``role: tool``
    messages, placed before the rest of that user turn (images inside a tool
    result go into that following user message, as tool messages carry text).
    A user turn of text blocks only becomes one string (blocks joined with
    a newline), the form every engine's chat template takes; an assistant
    turn's text blocks are concatenated.

    Returns:
        A new OpenAI chat request document (``doc`` is not changed).

    Raises:
        ApiError: 400 ``invalid_request_error`` naming the bad field (its
            path, e.g. ``messages.2.content.0.type``, is the ``param``).
    """
    model = request_model(doc)
    max_tokens = doc.get("max_tokens")
    if not (counting and max_tokens is None) and (not is_int(max_tokens) or max_tokens < 1):
        raise bad_request("'max_tokens' is required and must be an integer ≥ 1.", "max_tokens")

    messages: list[dict[str, Any]] = []
    system = _system_text(doc.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    raw_messages = doc.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("'messages' must be a non-empty list.", "messages")
    for index, message in enumerate(raw_messages):
        messages.extend(_message(message, f"messages.{index}"))

    chat: dict[str, Any] = {"model": model, "messages": messages}
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    stop = doc.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request(
                "'stop_sequences' must be a list of non-empty strings.", "stop_sequences"
            )
        if stop:
            chat["stop"] = list(stop)
    copy_sampling(doc, chat)
    top_k = doc.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < 0:
            raise bad_request("'top_k' must be a non-negative integer.", "top_k")
        chat["top_k"] = top_k
    copy_stream(doc, chat)
    tools = _tools(doc.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = doc.get("tool_choice")
    if choice is not None:
        chat_choice, parallel = _tool_choice(choice)
        if tools:
            chat["tool_choice"] = chat_choice
            if parallel is False:
                chat["parallel_tool_calls"] = False
    metadata = doc.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("'metadata' must be an object.", "metadata")
        user = metadata.get("user_id")
        if user is not None:
            if not isinstance(user, str):
                raise bad_request("'metadata.user_id' must be a string.", "metadata.user_id")
            chat["user"] = user
    return chat


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise bad_request(f"'{where}' must be a content block object.", where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad_request(f"'{where}.type' must be a string.", f"{where}.type")
    return kind


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"'{where}.text' must be a string.", f"{where}.text")
    return text


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of text blocks.", "system")
    texts = []
    for index, block in enumerate(system):
        where = f"system.{index}"
        if _block_type(block, where) != "text":
            raise bad_request(f"'{where}' must be a text block.", f"{where}.type")
        texts.append(_text_of(block, where))
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"'{where}.source' must be an object.", f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str) or not data:
            raise bad_request(
                f"'{where}.source' needs string 'media_type' and 'data'.", f"{where}.source"
            )
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        link = source.get("url")
        if not isinstance(link, str) or not link:
            raise bad_request(f"'{where}.source.url' must be a string.", f"{where}.source.url")
        url = link
    else:
        raise bad_request(
            f"'{where}.source.type' must be 'base64' or 'url' (got {kind!r}).",
            f"{where}.source.type",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _document_text(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "text":
        raise bad_request(
            f"'{where}': only documents with a plain-text source are supported.",
            f"{where}.source",
        )
    data = source.get("data")
    if not isinstance(data, str):
        raise bad_request(f"'{where}.source.data' must be a string.", f"{where}.source.data")
    title = block.get("title")
    return f"{title}\n{data}" if isinstance(title, str) and title else data


def _user_part(block: Any, at: str) -> dict[str, Any]:
    """A text, image or document block as an OpenAI content part."""
    kind = _block_type(block, at)
    if kind == "text":
        return {"type": "text", "text": _text_of(block, at)}
    if kind == "image":
        return _image_part(block, at)
    if kind == "document":
        return {"type": "text", "text": _document_text(block, at)}
    raise bad_request(
        f"'{at}': content blocks of type {kind!r} are not supported here.", f"{at}.type"
    )


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A plain string when every part is text (the widest engine support)."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object.", where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"'{where}.role' must be 'user' or 'assistant'.", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(
            f"'{where}.content' must be a string or a list of content blocks.", f"{where}.content"
        )
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    return _user(content, f"{where}.content")


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.{index}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            ident, name = block.get("id"), block.get("name")
            if not isinstance(ident, str) or not ident:
                raise bad_request(f"'{at}.id' must be a non-empty string.", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise bad_request(f"'{at}.name' must be a non-empty string.", f"{at}.name")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"'{at}.input' must be an object.", f"{at}.input")
            calls.append(
                {
                    "id": ident,
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad_request(
                f"'{at}': content blocks of type {kind!r} are not supported in assistant turns.",
                f"{at}.type",
            )
    text = "".join(texts)
    chat: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        chat["tool_calls"] = calls
    return chat


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.{index}"
        if _block_type(block, at) != "tool_result":
            parts.append(_user_part(block, at))
            continue
        ident = block.get("tool_use_id")
        if not isinstance(ident, str) or not ident:
            raise bad_request(
                f"'{at}.tool_use_id' must be a non-empty string.", f"{at}.tool_use_id"
            )
        result = block.get("content", "")
        if isinstance(result, str):
            text = result
        elif isinstance(result, list):
            result_parts = [
                _user_part(item, f"{at}.content.{number}") for number, item in enumerate(result)
            ]
            text = "\n".join(part["text"] for part in result_parts if part["type"] == "text")
            images += [part for part in result_parts if part["type"] != "text"]
        else:
            raise bad_request(
                f"'{at}.content' must be a string or a list of blocks.", f"{at}.content"
            )
        tool_messages.append({"role": "tool", "tool_call_id": ident, "content": text})
    parts += images
    if parts or not tool_messages:
        tool_messages.append({"role": "user", "content": _user_content(parts)})
    return tool_messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for at, tool in tool_objects(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(
                f"'{at}': tools of type {kind!r} are not supported; only custom tools "
                "(name, description, input_schema).",
                f"{at}.type",
            )
        out.append(chat_tool(tool, at, "input_schema", default=None))
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """OpenAI's ``tool_choice`` and whether parallel calls are allowed (None: unsaid)."""
    if not isinstance(choice, dict):
        raise bad_request("'tool_choice' must be an object.", "tool_choice")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(
            "'tool_choice.disable_parallel_tool_use' must be a boolean.",
            "tool_choice.disable_parallel_tool_use",
        )
    allowed = None if parallel is None else not parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'tool_choice.name' must be a non-empty string.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, allowed
    if isinstance(kind, str) and kind in _CHAT_TOOL_CHOICE:
        return _CHAT_TOOL_CHOICE[kind], allowed
    raise bad_request(
        "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type"
    )


# -- the answer -------------------------------------------------------------------------


def stop_reason(finish_reason: Any, *, tool_use: bool = False, stop_string: Any = None) -> str:
    """Anthropic's ``stop_reason`` for an OpenAI ``finish_reason``.

    ``length`` → ``max_tokens``; ``tool_calls`` (or a ``stop`` after tool
    calls, as some engines say) → ``tool_use``; ``content_filter`` →
    ``refusal``; ``stop`` with a known stop string (vLLM's ``stop_reason``)
    → ``stop_sequence``; anything else → ``end_turn``.
    """
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "content_filter":
        return "refusal"
    if finish_reason in ("tool_calls", "function_call") or tool_use:
        return "tool_use"
    if finish_reason == "stop" and isinstance(stop_string, str) and stop_string:
        return "stop_sequence"
    return "end_turn"


def _usage_doc(usage: Usage | None) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {
        "input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's ``arguments`` (JSON text) as a ``tool_use`` ``input`` object.

    Blank arguments give ``{}``. Arguments that are not a JSON object (bad
    JSON, or a list, string…) give ``{"_raw_arguments": <the text>}`` so the
    client sees what the model said rather than a silent empty call.
    """
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}


def chat_to_message(
    chat: dict[str, Any], model: str, *, message_id: str | None = None
) -> dict[str, Any]:
    """Translate an OpenAI ``chat.completion`` into an Anthropic ``message``.

    Reads the first choice. Content blocks, in order: a ``thinking`` block
    (the reasoning text, ``signature: ""``), a ``text`` block (when the
    content is not empty), a ``tool_use`` block per tool call (``input``:
    see :func:`tool_input`; ``id``: the engine's call id, or a new
    ``toolu_…``). ``stop_reason``: see :func:`stop_reason`. ``usage``:
    ``input_tokens`` = prompt - cached, ``cache_read_input_tokens`` =
    cached, ``output_tokens`` = completion (all 0 when the engine sent none).

    Args:
        chat: the engine's answer (anything malformed counts as empty).
        model: the model name to report (the one the client asked for).
        message_id: the id to use; a new ``msg_…`` when None.
    """
    choice, message = answer_choice(chat)
    content: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        ident = call.get("id")
        name = function.get("name")
        content.append(
            {
                "type": "tool_use",
                "id": ident if isinstance(ident, str) and ident else _tool_id(),
                "name": name if isinstance(name, str) else "",
                "input": tool_input(function.get("arguments")),
            }
        )
    reason = stop_reason(
        choice.get("finish_reason"),
        tool_use=any(block["type"] == "tool_use" for block in content),
        stop_string=choice.get("stop_reason"),
    )
    sequence = choice.get("stop_reason") if reason == "stop_sequence" else None
    return {
        "id": message_id or new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage_doc(usage_from(chat)),
    }


def _tool_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


# -- errors -----------------------------------------------------------------------------


def error_event(type: str, message: str) -> bytes:
    """An Anthropic ``event: error`` SSE frame (``type`` e.g.
    ``overloaded_error`` or ``api_error``), to end a stream that broke."""
    return _event("error", {"type": "error", "error": {"type": type, "message": message}})


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


# -- streaming --------------------------------------------------------------------------


class MessagesStream(ChatStreamTranslator[int]):
    """Translates an engine's OpenAI chat stream into Anthropic's events.

    Sans-IO (see :class:`~llmgw.gateway.chat_stream.ChatStreamTranslator`,
    whose attributes it has): :meth:`feed` takes the engine's SSE bytes
    (cut anywhere) and returns Anthropic SSE bytes (``event: X\\ndata:
    {json}\\n\\n``, every event in hand joined, possibly empty), in
    Anthropic's order: ``message_start`` (:meth:`start`); per block
    ``content_block_start``, ``content_block_delta`` (``thinking_delta``,
    ``text_delta``, ``input_json_delta``), ``content_block_stop``; then at
    ``[DONE]`` (or :meth:`finish`) ``message_delta`` (``stop_reason``,
    ``stop_sequence``, final ``usage``) and ``message_stop``. A change of
    kind (reasoning → text → tool call) closes the open block and opens the
    next; each tool call index gets its own ``tool_use`` block (a call's
    first delta should carry its ``function.name``; a missing id gets a new
    ``toolu_…``). A stream the engine broke off ends with ``end_turn``.

    ``message_start`` reports ``input_tokens`` as the estimate given (the
    engine's count only comes at the end); ``message_delta`` reports the
    final ``input_tokens``, ``cache_read_input_tokens`` and
    ``output_tokens`` (see the module doc for the split). Only choice 0 is
    read. An error the engine sends mid-stream becomes an ``error`` event
    and ends the stream.

    Args:
        model: the model name to report.
        message_id: the message id (:func:`new_message_id`).
        input_tokens: the prompt estimate for ``message_start``.
    """

    def __init__(self, model: str, message_id: str, *, input_tokens: int = 0) -> None:
        super().__init__()
        self.model = model
        self.message_id = message_id
        self.input_tokens = input_tokens
        self._next_index = 0
        self._open: str | None = None  # "reasoning", "text" or "tool"
        self._open_index = 0

    def error_event(self, type: str, message: str) -> bytes:
        """An ``event: error`` frame (see :func:`error_event`); marks the stream done."""
        self.done = True
        return error_event(type, message)

    # -- internals

    def _start_events(self, out: list[bytes]) -> None:
        out.append(
            _event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.message_id,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                    },
                },
            )
        )

    def _engine_failed(self, message: str) -> bytes:
        return self.error_event("api_error", message)

    def _open_block(self, kind: str, block: dict[str, Any], out: list[bytes]) -> int:
        self._close(out)
        index = self._next_index
        self._next_index += 1
        self._open, self._open_index = kind, index
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return index

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(
                _event(
                    "content_block_stop", {"type": "content_block_stop", "index": self._open_index}
                )
            )
            self._open = None

    def _delta(self, index: int, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        )

    def _text(self, kind: TextKind, text: str, out: list[bytes]) -> None:
        if self._open != kind:
            if kind == "text":
                block: dict[str, Any] = {"type": "text", "text": ""}
            else:
                block = {"type": "thinking", "thinking": "", "signature": ""}
            self._open_block(kind, block, out)
        if kind == "text":
            self._delta(self._open_index, {"type": "text_delta", "text": text}, out)
        else:
            self._delta(self._open_index, {"type": "thinking_delta", "thinking": text}, out)

    def _new_call_id(self) -> str:
        return _tool_id()

    def _call_start(self, call_id: str, name: str, out: list[bytes]) -> int:
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return self._open_block("tool", block, out)

    def _call_arguments(self, call: int, arguments: str, out: list[bytes]) -> None:
        self._delta(call, {"type": "input_json_delta", "partial_json": arguments}, out)

    def _end(self, out: list[bytes]) -> None:
        self._close(out)
        reason = stop_reason(
            self.finish_reason, tool_use=bool(self._calls), stop_string=self._stop_string
        )
        if self.usage is not None:
            usage = _usage_doc(self.usage)
        else:
            usage = {"output_tokens": self.content_chunks}
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": reason,
                        "stop_sequence": self._stop_string if reason == "stop_sequence" else None,
                    },
                    "usage": usage,
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
