"""Catalog entries as people write them, and the checks every entry passes.

``docs/catalog.md``, "A catalog entry". Two steps, both pure:

- :func:`parse_model` turns the YAML/JSON form (``ctl model add -f FILE``,
  the admin API, server.yaml's catalog) into a
  :class:`~llmgw.store.records.ModelRecord`. It takes the store's own form
  (:func:`~llmgw.store._catalog_json.model_from_doc`) plus conveniences::

      name: qwen2.5-7b
      source: /models/qwen2.5-7b-instruct-q4_k_m.gguf
      engine: llamacpp          # top-level profile fields = one profile "default"
      context: 16384            # = context_tokens
      slots: 4
      cpu_cores: 8
      min_memory_gb: 8
      scaling: {min: 1, max: 2} # = the profile's replicas (max)

      name: gpt-outside
      source: external          # or leave source out
      external: {url: https://api.example.com, model: gpt-x,
                 api_key_file: /etc/llmgw/keys/x}   # or api_key_files: [{file, weight}]

  Types are checked strictly (``allow_pickle: "no"`` is refused, not true)
  and an unknown key is refused naming its path (``profiles[0].enigne``).
- :func:`validate_model` checks an entry against the rules and the rest of
  the catalog, listing every problem at once.

Both raise :class:`CatalogError`.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import yaml

from llmgw import errors
from llmgw.control.planning import ModelFacts, suggested_min_memory_gb, tp_fits_kv_heads
from llmgw.engines.registry import check_args, check_env, get_adapter
from llmgw.settings import ROUTING_PROFILES, parse_duration_s
from llmgw.store._catalog_json import model_from_doc
from llmgw.store.records import ModelRecord, Profile

__all__ = [
    "MAX_NAME_LENGTH",
    "PICKLE_SUFFIXES",
    "CatalogError",
    "load_model_file",
    "parse_model",
    "validate_model",
]

#: The longest model, alias or profile name.
MAX_NAME_LENGTH: Final = 128
#: File suffixes of pickle-format weights (refused unless ``allow_pickle``).
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


class CatalogError(errors.InvalidInput):
    """A catalog entry is not valid.

    Attributes:
        problems: each problem found, one sentence each, naming the field's
            path (``profiles[0].slots``) and the figures involved; the
            message joins them with ``"; "``.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        super().__init__("; ".join(self.problems))


# --- parsing -------------------------------------------------------------------

_STR = "a string"
_INT = "an integer"
_NUM = "a number"
_BOOL = "true or false"
_STRS = "a list of strings"
_ARGS = "a list of arguments"
_STRMAP = "a mapping of strings"
_DURATION = "a duration (seconds, or 45s, 30m, 12h)"

_MODEL_FIELDS: Final[dict[str, str]] = {
    "name": _STR,
    "source": _STR,
    "sha256": _STR,
    "aliases": _STRS,
    "description": _STR,
    "allow_pickle": _BOOL,
    "on_demand": _BOOL,
    "stopped": _BOOL,
    "context_length": _INT,
    "max_output": _INT,
    "fallbacks": _STRS,
    "routing": _STR,
    "capabilities": _STRS,
    "owner": _STR,
    "created_at": _NUM,
}
_PROFILE_FIELDS: Final[dict[str, str]] = {
    "name": _STR,
    "engine": _STR,
    "gpu_class": _STR,
    "gpus": _INT,
    "tp": _INT,
    "cpu_cores": _INT,
    "min_memory_gb": _NUM,
    "context_tokens": _INT,
    "slots": _INT,
    "args": _ARGS,
    "env": _STRMAP,
    "priority": _INT,
    "replicas": _INT,
    "startup_timeout_s": _NUM,
    "selector": _STRMAP,
}
#: Convenience spellings inside a profile -> (field, kind).
_PROFILE_ALIASES: Final[dict[str, tuple[str, str]]] = {
    "context": ("context_tokens", _INT),
    "gpus_per_node": ("gpus", _INT),
    "startup_timeout": ("startup_timeout_s", _DURATION),
}
#: Profile keys that may stand at the top level, meaning one profile ``default``.
_TOP_PROFILE_KEYS: Final = frozenset((set(_PROFILE_FIELDS) - {"name"}) | set(_PROFILE_ALIASES))


def _kind_error(path: str, kind: str, value: object) -> CatalogError:
    return CatalogError(f"{path}: expected {kind}, got {type(value).__name__} {value!r}")


def _scalar_text(value: object) -> str | None:
    """Numbers and strings as text (YAML reads ``4`` and ``--threads`` alike)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _check(value: object, kind: str, path: str) -> Any:
    """``value`` as ``kind``, strictly; raises :class:`CatalogError` naming ``path``."""
    if kind == _STR:
        if isinstance(value, str):
            return value
    elif kind in (_INT, _NUM):
        if isinstance(value, bool):
            raise _kind_error(path, kind, value)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value):
            if kind == _NUM:
                return value
            if value.is_integer():
                return int(value)
    elif kind == _BOOL:
        if isinstance(value, bool):
            return value
    elif kind == _STRS:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return list(value)
    elif kind == _ARGS:
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise CatalogError(f"{path}: cannot split {value!r}: {exc}") from None
        if isinstance(value, list | tuple):
            texts = [_scalar_text(v) for v in value]
            if all(t is not None for t in texts):
                return texts
    elif kind == _STRMAP:
        if isinstance(value, Mapping):
            out: dict[str, str] = {}
            for key, item in value.items():
                text = _scalar_text(item)
                if not isinstance(key, str) or text is None:
                    raise _kind_error(f"{path}.{key}", _STR, item)
                out[key] = text
            return out
    elif kind == _DURATION:
        try:
            return parse_duration_s(value)
        except ValueError as exc:
            raise CatalogError(f"{path}: {exc}") from None
    raise _kind_error(path, kind, value)


def _mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _kind_error(path, "a mapping", value)
    for key in value:
        if not isinstance(key, str):
            raise CatalogError(f"{path}: key {key!r} is not a string")
    return value


def _unknown(key: str, path: str, known: Sequence[str]) -> CatalogError:
    where = f"{path}.{key}" if path else key
    return CatalogError(f"{where}: unknown key (known: {', '.join(sorted(known))})")


def _parse_profile(doc: Mapping[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _PROFILE_FIELDS:
            field, kind = key, _PROFILE_FIELDS[key]
        elif key in _PROFILE_ALIASES:
            field, kind = _PROFILE_ALIASES[key]
        else:
            raise _unknown(key, path, [*_PROFILE_FIELDS, *_PROFILE_ALIASES])
        if field in out:
            raise CatalogError(f"{path}: {field} is given twice (as {key} too)")
        out[field] = _check(value, kind, f"{path}.{key}")
    if "engine" not in out:
        raise CatalogError(f"{path}.engine: missing (e.g. llamacpp, vllm, sim)")
    return out


def _parse_external(doc: Mapping[str, Any]) -> dict[str, Any]:
    known = ("url", "model", "api_key_file", "api_key_files")
    for key in doc:
        if key not in known:
            raise _unknown(key, "external", known)
    out: dict[str, Any] = {}
    for key in ("url", "model"):
        if key not in doc:
            raise CatalogError(f"external.{key}: missing")
        out[key] = _check(doc[key], _STR, f"external.{key}")
    if "api_key_file" in doc and "api_key_files" in doc:
        raise CatalogError("external: give api_key_file or api_key_files, not both")
    keys: list[dict[str, Any]] = []
    if "api_key_file" in doc:
        keys.append({"file": _check(doc["api_key_file"], _STR, "external.api_key_file")})
    elif "api_key_files" in doc:
        items = doc["api_key_files"]
        if not isinstance(items, list | tuple):
            raise _kind_error("external.api_key_files", "a list of {file, weight}", items)
        for i, item in enumerate(items):
            where = f"external.api_key_files[{i}]"
            if isinstance(item, str):
                keys.append({"file": item})
                continue
            entry = _mapping(item, where)
            for key in entry:
                if key not in ("file", "weight"):
                    raise _unknown(key, where, ("file", "weight"))
            if "file" not in entry:
                raise CatalogError(f"{where}.file: missing")
            key_doc: dict[str, Any] = {"file": _check(entry["file"], _STR, f"{where}.file")}
            if "weight" in entry:
                key_doc["weight"] = _check(entry["weight"], _INT, f"{where}.weight")
            keys.append(key_doc)
    out["api_key_files"] = keys
    return out


def _parse_scaling(value: object) -> tuple[int, int]:
    scaling = _mapping(value, "scaling")
    for key in scaling:
        if key not in ("min", "max"):
            raise _unknown(key, "scaling", ("min", "max"))
    if "max" not in scaling:
        raise CatalogError("scaling.max: missing")
    high = _check(scaling["max"], _INT, "scaling.max")
    low = _check(scaling.get("min", high), _INT, "scaling.min")
    if low < 0 or high < 0 or low > high:
        raise CatalogError(f"scaling: need 0 <= min <= max, got min {low}, max {high}")
    return low, high


def parse_model(doc: Mapping[str, Any]) -> ModelRecord:
    """A catalog entry from the form people write (YAML/JSON types).

    Accepted besides the store's own form (``profiles: [{engine, …}]``):

    - profile fields at the top level (``engine``, ``replicas``,
      ``context``/``context_tokens``, ``slots``, ``cpu_cores``,
      ``min_memory_gb``, ``args``, ``env``, ``gpu_class``, ``gpus``, ``tp``,
      ``priority``, ``selector``, ``startup_timeout``): one profile named
      ``default`` (not together with ``profiles``);
    - in a profile: ``context`` = ``context_tokens``, ``gpus_per_node`` =
      ``gpus``, ``startup_timeout: 20m`` = ``startup_timeout_s``; ``args`` as
      one string is split like a shell; numbers in ``args``/``env`` become text;
    - ``scaling: {min, max}``: with one profile its ``replicas`` = ``max``;
      with several, ``max`` must equal the sum of their replicas
      (``0/0`` = none running); ``min`` is checked (``0 <= min <= max``)
      but not kept;
    - ``source: external`` (stored as an empty source) with ``external:
      {url, model, api_key_file | api_key_files: [{file, weight} | file]}``.

    Only the form is checked here; :func:`validate_model` checks the rules.

    Raises:
        CatalogError: not a mapping, a key unknown (named with its path,
            ``profiles[1].enigne``), a value of the wrong type, a field
            given twice, ``name``/``engine``/``external.url`` missing, or
            ``scaling`` inconsistent with the profiles.
    """
    doc = _mapping(doc, "model")
    out: dict[str, Any] = {}
    top_profile: dict[str, Any] = {}
    scaling: tuple[int, int] | None = None
    for key, value in doc.items():
        if key in _MODEL_FIELDS:
            out[key] = _check(value, _MODEL_FIELDS[key], key)
        elif key in _TOP_PROFILE_KEYS:
            top_profile[key] = value
        elif key == "profiles":
            if not isinstance(value, list | tuple):
                raise _kind_error("profiles", "a list of profiles", value)
            out["profiles"] = [
                _parse_profile(_mapping(item, f"profiles[{i}]"), f"profiles[{i}]")
                for i, item in enumerate(value)
            ]
        elif key == "external":
            if value is not None:
                out["external"] = _parse_external(_mapping(value, "external"))
        elif key == "scaling":
            scaling = _parse_scaling(value)
        elif key == "origin":
            if value is not None:
                out["origin"] = dict(_mapping(value, "origin"))
        else:
            known = [
                *_MODEL_FIELDS, "profiles", "external", "scaling", "origin", *_TOP_PROFILE_KEYS
            ]  # fmt: skip
            raise _unknown(key, "", known)
    if "name" not in out:
        raise CatalogError("name: missing")
    if top_profile:
        if "profiles" in out:
            keys = ", ".join(sorted(top_profile))
            raise CatalogError(
                f"{keys}: profile fields at the top level describe the one profile; "
                "with profiles: put them in a profile"
            )
        out["profiles"] = [_parse_profile(top_profile, "profile")]
    if out.get("source") == "external":
        if "external" not in out:
            raise CatalogError("external: missing (source: external needs the block)")
        out["source"] = ""
    if scaling is not None:
        _apply_scaling(out, scaling)
    try:
        return model_from_doc(out)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def _apply_scaling(out: dict[str, Any], scaling: tuple[int, int]) -> None:
    _, high = scaling
    profiles: list[dict[str, Any]] = out.get("profiles", [])
    if not profiles:
        raise CatalogError("scaling: a model without profiles has no replicas to scale")
    if len(profiles) == 1:
        given = profiles[0].get("replicas")
        if given is not None and given != high:
            raise CatalogError(f"scaling.max {high} disagrees with replicas {given}")
        profiles[0]["replicas"] = high
        return
    default = attrs.fields(Profile).replicas.default or 0
    total = sum(int(p.get("replicas", default)) for p in profiles)
    if total != high:
        raise CatalogError(
            f"scaling.max {high} disagrees with the profiles' replicas, which add up to {total}"
        )


def load_model_file(path: Path | str) -> ModelRecord:
    """:func:`parse_model` of a YAML (or JSON) file.

    Raises:
        CatalogError: the file cannot be read, is not UTF-8 or not YAML, or what
            :func:`parse_model` raises.
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{path}: not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not YAML: {exc}") from None
    return parse_model(doc)


# --- validation ----------------------------------------------------------------


def _name_problem(what: str, name: str) -> str | None:
    if not name:
        return f"{what} is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"{what} {name[:20]!r}… is {len(name)} characters, more than {MAX_NAME_LENGTH}"
    if not _NAME.match(name):
        return (
            f"{what} {name!r} may hold only letters, digits and . - _ : / "
            "and must start with a letter or digit"
        )
    return None


def _is_pickle(source: str) -> bool:
    text = source.strip()
    if "://" in text:
        try:
            text = urlsplit(text).path
        except ValueError:  # not a URL urllib reads ("Invalid IPv6 URL"): judge the text
            text = text.split("://", 1)[1]
    text = text.split("?", 1)[0].rstrip("/").lower()
    return text.endswith(PICKLE_SUFFIXES)


def _profile_problems(
    profile: Profile,
    where: str,
    *,
    trained: int,
    facts: ModelFacts | None,
    new: bool,
) -> list[str]:
    problems: list[str] = []
    name_problem = _name_problem(f"{where}.name", profile.name)
    if name_problem:
        problems.append(name_problem)
    try:
        get_adapter(profile.engine)
    except ValueError as exc:
        problems.append(f"{where}.engine: {exc}")
    else:
        try:
            check_args(profile.engine, profile.args)
        except ValueError as exc:
            problems.append(f"{where}.args: {exc}")
    try:
        check_env(profile.env)
    except ValueError as exc:
        problems.append(f"{where}.env: {exc}")
    for field, value, low in (
        ("slots", profile.slots, 1),
        ("context_tokens", profile.context_tokens, 1),
        ("tp", profile.tp, 1),
        ("gpus", profile.gpus, 0),
        ("cpu_cores", profile.cpu_cores, 0),
        ("replicas", profile.replicas, 0),
    ):
        if value < low:
            problems.append(f"{where}.{field} must be at least {low}, not {value}")
    if profile.min_memory_gb < 0 or not math.isfinite(profile.min_memory_gb):
        problems.append(f"{where}.min_memory_gb must be 0 or more, not {profile.min_memory_gb}")
    if profile.startup_timeout_s <= 0:
        problems.append(
            f"{where}.startup_timeout_s must be more than 0, not {profile.startup_timeout_s}"
        )
    if profile.gpu_class:
        if profile.gpus < 1:
            problems.append(f"{where}.gpus must be at least 1 with gpu_class {profile.gpu_class}")
        elif profile.tp >= 1 and profile.gpus % profile.tp:
            problems.append(
                f"{where}: {profile.gpus} gpus cannot be split into tensor-parallel groups "
                f"of {profile.tp}"
            )
        if "-mig-" in profile.gpu_class and (profile.tp != 1 or profile.gpus != 1):
            problems.append(
                f"{where}: MIG class {profile.gpu_class} needs tp = gpus = 1, "
                f"not tp {profile.tp}, gpus {profile.gpus}"
            )
    else:
        if profile.engine == "vllm":
            problems.append(
                f"{where}: engine vllm runs on NVIDIA cards: give gpu_class and gpus "
                "(an empty gpu_class means CPU)"
            )
        if profile.gpus:
            problems.append(
                f"{where}.gpus is {profile.gpus} but gpu_class is empty (empty means CPU)"
            )
        if profile.tp != 1:
            problems.append(f"{where}.tp is {profile.tp} on CPU (no gpu_class); it must be 1")
        if new and profile.min_memory_gb <= 0:
            hint = ""
            if facts is not None:
                need = suggested_min_memory_gb(facts, profile.context_tokens)
                hint = f" (this model needs about {need} GB at {profile.context_tokens:,} tokens)"
            problems.append(
                f"{where}: a new CPU model must state its memory: min_memory_gb "
                f"(--min-memory-gb on the command line){hint}"
            )
    if facts is not None and profile.tp > 1 and not tp_fits_kv_heads(profile.tp, facts.kv_heads):
        problems.append(
            f"{where}.tp {profile.tp} neither divides the model's {facts.kv_heads} KV heads "
            "nor is a multiple of them"
        )
    if trained and profile.slots >= 1:
        per_slot = profile.context_tokens // profile.slots
        if per_slot > trained:
            problems.append(
                f"{where}: context per slot {per_slot:,} tokens ({profile.context_tokens:,} / "
                f"{profile.slots} slots) is beyond the model's trained {trained:,}"
            )
    return problems


def validate_model(
    model: ModelRecord,
    existing: Sequence[ModelRecord] = (),
    *,
    facts: ModelFacts | None = None,
    new: bool | None = None,
) -> None:
    """Check ``model`` against the catalog rules and the rest of the catalog.

    Args:
        model: the entry to add or update.
        existing: the catalog as it is; unless ``new``, an entry named
            ``model.name`` is the one being replaced and is left out of the
            uniqueness checks.
        facts: the model's shape (:func:`~llmgw.control.planning.read_model_facts`),
            when its files could be read: enables the KV-head and trained-
            context checks (``facts.context_length`` wins over
            ``model.context_length``) and figures in messages.
        new: whether the entry is being added (a CPU profile must then
            state ``min_memory_gb``, and its name must not be taken by any
            entry); ``None`` = no entry of that name in ``existing``.

    Rules (spec "Validation" and "Model entry"):

    - names and aliases: letters, digits, ``. - _ : /``, starting with a
      letter or digit, at most 128 characters; unique across the catalog's
      names and aliases and within the entry;
    - ``sha256``: 64 hex digits when set; ``routing`` in :data:`ROUTING_PROFILES`;
      ``fallbacks`` not naming the model itself;
    - a pickle-format source (:data:`PICKLE_SUFFIXES`) needs ``allow_pickle``;
    - an external model: ``url`` http(s) with a host, ``model`` set, at
      least one key file, key weights >= 0, and no profiles; any other
      model at least one profile;
    - each profile: a unique name; engine known to the registry
      (:func:`~llmgw.engines.registry.get_adapter`); ``args``/``env``
      vetted (``check_args``, ``check_env``, engines.md); ``slots``,
      ``context_tokens``, ``tp`` >= 1; ``gpus``, ``cpu_cores``,
      ``replicas``, ``min_memory_gb`` >= 0; on cards ``gpus >= 1`` and a
      multiple of ``tp``, a MIG class (``-mig-``) only with tp = gpus = 1;
      on CPU ``gpus = 0``, ``tp = 1``, and for a new model
      ``min_memory_gb > 0``; ``tp`` dividing the KV heads or a multiple of
      them (with ``facts``); context per slot (``context_tokens // slots``)
      not beyond the trained context;
    - ``max_output`` not beyond the trained context, nor (without one) the
      largest context per slot of the profiles.

    Raises:
        CatalogError: listing every problem found (``problems``).
    """
    problems: list[str] = []
    if new is None:
        new = all(m.name != model.name for m in existing)
    # Updating: the stored entry of that name is the one being replaced.
    others = list(existing) if new else [m for m in existing if m.name != model.name]

    name_problem = _name_problem("name", model.name)
    if name_problem:
        problems.append(name_problem)
    taken: dict[str, str] = {}
    for other in others:
        taken[other.name] = f"the name of {other.name}"
        for alias in other.aliases:
            taken.setdefault(alias, f"an alias of {other.name}")
    if model.name in taken:
        problems.append(f"name {model.name!r} is already {taken[model.name]}")
    seen = {model.name}
    for i, alias in enumerate(model.aliases):
        alias_problem = _name_problem(f"aliases[{i}]", alias)
        if alias_problem:
            problems.append(alias_problem)
        elif alias in seen:
            problems.append(f"aliases[{i}] {alias!r} repeats the model's name or another alias")
        elif alias in taken:
            problems.append(f"aliases[{i}] {alias!r} is already {taken[alias]}")
        seen.add(alias)

    if model.sha256 and not _SHA256.match(model.sha256):
        problems.append("sha256 must be 64 hex digits")
    problems.extend(_origin_problems(model))
    if model.routing not in ROUTING_PROFILES:
        problems.append(f"routing {model.routing!r} is not one of {', '.join(ROUTING_PROFILES)}")
    for i, fallback in enumerate(model.fallbacks):
        if fallback in seen:
            problems.append(f"fallbacks[{i}] {fallback!r} names the model itself")
    if model.source and _is_pickle(model.source) and not model.allow_pickle:
        problems.append(
            f"source {model.source!r} is a pickle-format file, which can run code when "
            "loaded; set allow_pickle to accept it deliberately"
        )
    if model.context_length < 0:
        problems.append(f"context_length must be 0 or more, not {model.context_length}")
    if model.max_output < 0:
        problems.append(f"max_output must be 0 or more, not {model.max_output}")

    if model.external is not None:
        external = model.external
        parts = urlsplit(external.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"external.url {external.url!r} must be an http(s) URL with a host")
        if not external.model:
            problems.append("external.model is empty")
        if not external.api_key_files:
            problems.append("external needs at least one key file (api_key_file)")
        for i, key in enumerate(external.api_key_files):
            if not key.file:
                problems.append(f"external.api_key_files[{i}].file is empty")
            if key.weight < 0:
                problems.append(f"external.api_key_files[{i}].weight must be 0 or more")
        if model.profiles:
            problems.append("an external model has no profiles (it runs elsewhere)")
    elif not model.profiles:
        problems.append("profiles: at least one is needed (or an external block)")

    trained = (facts.context_length if facts is not None else 0) or model.context_length
    names: set[str] = set()
    for i, profile in enumerate(model.profiles):
        where = f"profiles[{i}]"
        if profile.name in names:
            problems.append(f"{where}.name {profile.name!r} is used by another profile")
        names.add(profile.name)
        problems.extend(_profile_problems(profile, where, trained=trained, facts=facts, new=new))

    if model.max_output > 0:
        if trained and model.max_output > trained:
            problems.append(
                f"max_output {model.max_output:,} is beyond the trained context {trained:,}"
            )
        elif not trained and model.profiles:
            largest = max(p.context_tokens // max(p.slots, 1) for p in model.profiles)
            if model.max_output > largest:
                problems.append(
                    f"max_output {model.max_output:,} is beyond the largest context per slot "
                    f"{largest:,} of the profiles"
                )
    if problems:
        raise CatalogError(problems)


def _origin_problems(model: ModelRecord) -> list[str]:
    """A pinned ``origin`` (``docs/models-from-hf.md``): kind ``hf``, a
    40-hex commit, files with 64-hex digests and no pickle format, the main
    file among them, and the ``source`` naming the same commit. An ``hf:``
    source needs an origin (only ``ctl model serve hf:…`` pins one)."""
    origin = model.origin
    if origin is None:
        if model.source.startswith("hf:"):
            return [
                f"source {model.source!r} is a Hugging Face repository, which must be pinned "
                "first: use llmgw ctl model serve hf:ORG/REPO[@REV] (it resolves the commit "
                "and the files) rather than ctl model add"
            ]
        return []
    problems: list[str] = []
    if origin.kind != "hf":
        problems.append(f"origin.kind {origin.kind!r} is not hf")
    if not re.fullmatch(r"[0-9a-f]{40}", origin.revision):
        problems.append("origin.revision must be a commit: 40 hex digits")
    if not origin.files:
        problems.append("origin.files is empty")
    for i, file in enumerate(origin.files):
        if not _SHA256.match(file.sha256):
            problems.append(f"origin.files[{i}].sha256 must be 64 hex digits")
        if file.path.lower().endswith(PICKLE_SUFFIXES) and not model.allow_pickle:
            problems.append(
                f"origin.files[{i}]: {file.path} is a pickle format (set allow_pickle to accept)"
            )
        if file.path.startswith("/") or ".." in file.path.split("/"):
            problems.append(f"origin.files[{i}].path {file.path!r} leaves the model directory")
    if origin.main_file and origin.main_file not in {f.path for f in origin.files}:
        problems.append(f"origin.main_file {origin.main_file!r} is not among origin.files")
    if not model.source.startswith(f"hf:{origin.repo}@{origin.revision}"):
        problems.append(
            f"source must be hf:{origin.repo}@{origin.revision}… when origin is set "
            "(ctl model update changes both)"
        )
    return problems
