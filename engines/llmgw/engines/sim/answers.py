"""What the sim engine answers, never by chance: the same request gets the
same answer.

- Tokens: a prompt's tokens are its whitespace-separated words
  (:func:`prompt_token_ids`); the answer is the words ``tok0 ``, ``tok1 `` …
  (:func:`answer_word`), and a small prefix cache (:class:`PrefixCache`)
  says how many prompt tokens were cached.
- Embeddings: unit vectors from a hash of each input (:func:`embedding`).
- Chat answers beyond plain text (:func:`rich_answer`): reasoning, a tool
  call, JSON for ``response_format``, cut at ``stop``, ``n`` choices.
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from llmgw.engines.sim.config import SimConfig
from llmgw.engines.sim.request import RequestError, bounded_int, flag, stop_strings

__all__ = [
    "ARGUMENTS",
    "CACHE_BLOCK_TOKENS",
    "CACHE_CAPACITY_BLOCKS",
    "CALL",
    "CONTENT",
    "REASONING",
    "Plan",
    "PrefixCache",
    "Rich",
    "answer_text",
    "answer_word",
    "embedding",
    "prompt_token_ids",
    "rich_answer",
]

#: Tokens per prefix-cache block (as vLLM's default block size).
CACHE_BLOCK_TOKENS = 16

#: Blocks the prefix cache remembers before forgetting the least recent.
CACHE_CAPACITY_BLOCKS = 65536

#: Token ids run from ``_FIRST_TOKEN_ID`` to ``_FIRST_TOKEN_ID + _VOCAB - 1``.
_VOCAB = 50000
_FIRST_TOKEN_ID = 100


# -- tokens and plain answers ----------------------------------------------------------


def prompt_token_ids(text: str) -> list[int]:
    """The sim tokenizer: one id per whitespace-separated word of ``text``.

    Ids are ``crc32(word) mod 50000 + 100``, the same in every process. An
    empty or blank text still has one token (id 1, like a BOS token).
    """
    ids = [zlib.crc32(word.encode()) % _VOCAB + _FIRST_TOKEN_ID for word in text.split()]
    return ids or [1]


def answer_word(index: int) -> str:
    """Answer token ``index``: ``tok7 `` for 7."""
    return f"tok{index} "


def answer_text(count: int) -> str:
    """The plain answer of ``count`` tokens: ``tok0 tok1 …``."""
    return "".join(answer_word(i) for i in range(count))


class PrefixCache:
    """Remembers prompts in blocks of :data:`CACHE_BLOCK_TOKENS` tokens, like a
    paged KV cache, so a repeated prefix reports ``cached_tokens``; forgets
    the least recent block beyond ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int = CACHE_CAPACITY_BLOCKS) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity_blocks

    def lookup_and_insert(self, ids: Sequence[int]) -> int:
        """Cached tokens for ``ids`` (full blocks, leaving at least the last
        token to compute), then remembers all of ``ids``' full blocks."""
        size = CACHE_BLOCK_TOKENS
        usable_blocks = (len(ids) - 1) // size
        cached = 0
        chain = 0
        hitting = True
        for block in range(len(ids) // size):
            chain = hash((chain, tuple(ids[block * size : (block + 1) * size])))
            if chain in self._blocks:
                self._blocks.move_to_end(chain)
                if hitting and block < usable_blocks:
                    cached += size
            else:
                hitting = False
                self._blocks[chain] = None
                if len(self._blocks) > self._capacity:
                    self._blocks.popitem(last=False)
        return cached


def embedding(data: bytes, dim: int) -> list[float]:
    """A unit vector of ``dim`` floats that depends only on ``data``."""
    seed = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
    rng = random.Random(seed)
    vector = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


@attrs.define
class Plan:
    """What one generation request will produce; ``done`` once its last
    bytes are handed to the server.

    Attributes:
        prompt_tokens: tokens of the prompt.
        cached_tokens: of those, tokens found in the prefix cache.
        completion_tokens: tokens answered (all choices together).
        finish_reason: OpenAI's ``finish_reason`` (``stop``, ``length``,
            ``tool_calls``).
        done: the answer's last bytes were handed to the server.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    done: bool = False

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# -- answers beyond plain text (chat) ----------------------------------------------------

#: Characters per streamed piece of JSON (tool call arguments, JSON answers).
_JSON_PIECE = 8

#: The most choices (``n``) and ``top_logprobs`` a request may ask for.
_MAX_CHOICES = 128
_MAX_TOP_LOGPROBS = 20

#: How deep :func:`_placeholder` follows a JSON schema.
_MAX_SCHEMA_DEPTH = 32

_PLACEHOLDERS: dict[Any, Any] = {
    "string": "sim",
    "number": 1,
    "integer": 1,
    "boolean": True,
    "array": [],
    "null": None,
}

#: Piece kinds: reasoning text, content text, a tool call's head (its text
#: is the function name), a piece of a tool call's arguments.
REASONING, CONTENT, CALL, ARGUMENTS = "r", "c", "t", "a"


@attrs.frozen
class Rich:
    """A chat answer on the slower path: the pieces of one choice (each
    streamed as one chunk and counted as one token), repeated ``n`` times.

    Attributes:
        pieces: ``(kind, text)`` pairs, kind one of :data:`REASONING`,
            :data:`CONTENT`, :data:`CALL`, :data:`ARGUMENTS`.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        n: the number of (identical) choices.
        top_logprobs: alternatives per logprobs entry; None when the
            request asked for no logprobs.
    """

    pieces: tuple[tuple[str, str], ...]
    finish_reason: str
    n: int
    top_logprobs: int | None

    def text(self, kind: str) -> str:
        """The text of the pieces of ``kind``, joined."""
        return "".join(text for k, text in self.pieces if k == kind)

    def tool_name(self) -> str | None:
        """The called function's name, or None when the answer calls none."""
        for kind, text in self.pieces:
            if kind == CALL:
                return text
        return None


def _placeholder(schema: Any, depth: int = 0) -> Any:
    """A value that fits a (simple) JSON schema: objects hold just their
    required properties; unknown shapes give ``"sim"``."""
    if depth > _MAX_SCHEMA_DEPTH or not isinstance(schema, dict):
        return "sim"
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _placeholder(options[0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        names = required if isinstance(required, list) else []
        return {
            name: _placeholder(properties.get(name), depth + 1)
            for name in names
            if isinstance(name, str)
        }
    return _PLACEHOLDERS.get(kind, "sim")


def _json_pieces(kind: str, text: str) -> list[tuple[str, str]]:
    return [(kind, text[i : i + _JSON_PIECE]) for i in range(0, len(text), _JSON_PIECE)]


def _tool_call(doc: dict[str, Any]) -> tuple[str, str] | None:
    """The (name, arguments JSON) of the call to answer with, or None."""
    tools = doc.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list")
    functions: dict[str, Any] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(400, "each tool needs 'function.name'")
        assert isinstance(function, dict)
        functions.setdefault(name, function)
    choice = doc.get("tool_choice")
    if choice is None or choice in ("auto", "required"):
        name = next(iter(functions))
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise RequestError(400, f"'tool_choice' names a tool not in 'tools': {name!r}")
    else:
        raise RequestError(400, "'tool_choice' must be none, auto, required or a function")
    last = doc["messages"][-1]  # the caller checked the list (request.chat_text)
    if last.get("role") != "user":
        return None
    arguments = _placeholder(functions[name].get("parameters"))
    if not isinstance(arguments, dict):
        arguments = {}
    return name, orjson.dumps(arguments).decode()


def _json_answer(response_format: Any, tokens: int) -> str | None:
    """The JSON text ``response_format`` asks for, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return orjson.dumps(_placeholder(schema)).decode()
        kind = "json_object"
    if kind == "json_object":
        return orjson.dumps({"answer": answer_text(tokens)}).decode()
    raise RequestError(400, "'response_format.type' must be text, json_object or json_schema")


def _cut_at_stop(
    pieces: list[tuple[str, str]], stops: list[str]
) -> tuple[list[tuple[str, str]], bool]:
    """``pieces`` with the content cut before the first stop string it holds."""
    content = "".join(text for kind, text in pieces if kind == CONTENT)
    found = [at for at in (content.find(stop) for stop in stops) if at >= 0]
    if not found:
        return pieces, False
    left = min(found)
    kept: list[tuple[str, str]] = []
    for kind, text in pieces:
        if kind != CONTENT:
            kept.append((kind, text))
            continue
        if left <= 0:
            break
        if len(text) >= left:
            kept.append((kind, text[:left]))
            break
        kept.append((kind, text))
        left -= len(text)
    return kept, True


def rich_answer(doc: dict[str, Any], config: SimConfig, max_tokens: int | None) -> Rich | None:
    """The answer to chat request ``doc`` (whose ``messages`` were checked)
    when it asks for more than plain text, else None (then the fast path
    answers).

    - ``tools``: when ``tool_choice`` is not ``"none"`` and the last message
      is the user's, one call to the first tool (or the one ``tool_choice``
      names) with arguments holding the schema's required properties as
      placeholders (string ``"sim"``, number/integer 1, boolean true, array
      [], object its own required ones), ``finish_reason`` ``tool_calls``;
      the arguments in 8-character pieces.
    - ``config.reasoning``: ``config.reasoning_tokens`` words ``thought0 ``
      … come first (``reasoning_content``).
    - ``n``: that many identical choices.
    - ``logprobs``/``top_logprobs``: kept in :attr:`Rich.top_logprobs`.
    - ``stop``: the content is cut before the first stop string it holds
      (``finish_reason`` ``stop``).
    - ``response_format`` ``json_object``: the content is ``{"answer":
      "tok0 …"}``; ``json_schema``: placeholders for the schema, as for tools.
    - ``max_tokens`` caps the pieces (reasoning first), ``finish_reason``
      ``length``.

    Raises:
        RequestError: a field named above is malformed.
    """
    n = doc.get("n")
    if not (
        config.reasoning
        or doc.get("tools")
        or doc.get("logprobs")
        or doc.get("stop")
        or doc.get("response_format")
        or (n is not None and n != 1)
    ):
        return None
    choices = bounded_int(doc, "n", 1, 1, _MAX_CHOICES)
    logprobs = flag(doc, "logprobs")
    top = bounded_int(doc, "top_logprobs", 0, 0, _MAX_TOP_LOGPROBS)
    stops = stop_strings(doc.get("stop"))
    call = _tool_call(doc)
    pieces: list[tuple[str, str]] = []
    if config.reasoning:
        pieces += [(REASONING, f"thought{i} ") for i in range(config.reasoning_tokens)]
    if call is not None:
        pieces.append((CALL, call[0]))
        pieces += _json_pieces(ARGUMENTS, call[1])
        finish = "tool_calls"
    else:
        json_text = _json_answer(doc.get("response_format"), config.tokens)
        if json_text is None:
            pieces += [(CONTENT, answer_word(i)) for i in range(config.tokens)]
        else:
            pieces += _json_pieces(CONTENT, json_text)
        finish = "stop"
    if max_tokens is not None and max_tokens <= len(pieces):
        pieces = pieces[:max_tokens]
        finish = "length"
    if stops and call is None:
        pieces, stopped = _cut_at_stop(pieces, stops)
        if stopped:
            finish = "stop"
    return Rich(tuple(pieces), finish, choices, top if logprobs else None)
