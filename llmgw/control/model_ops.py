"""Changes to one catalog entry, and to the weights behind it, that an
operator asks for: scale, change the context, check an entry against the
weights readable here, delete the weights of a removed model.

Pure functions over :class:`~llmgw.store.ModelRecord` (and, for
:func:`purge_weights` and :func:`local_facts`, the local filesystem); the
caller stores the result and updates the :class:`~llmgw.control.cluster.Cluster`.
The catalog's rules are in ``docs/catalog.md``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import attrs

from llmgw import errors
from llmgw.control.catalog import validate_model
from llmgw.control.planning import ModelFacts, PlanningError, read_model_facts
from llmgw.store import ModelRecord

__all__ = [
    "ModelChangeError",
    "change_context",
    "check_model",
    "local_facts",
    "purge_weights",
    "scale",
]

log = logging.getLogger("llmgw.control")


class ModelChangeError(errors.InvalidInput):
    """A change asked of a model cannot be made; the message says why.

    Attributes:
        param: the request field at fault (``profile``, ``tokens``,
            ``max_output``), or ``None``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def scale(model: ModelRecord, replicas: int, profile: str | None) -> ModelRecord:
    """``model`` scaled to ``replicas`` of ``profile`` (and started if stopped).

    Args:
        replicas: the count wanted, 0 or more.
        profile: the profile to scale; may be ``None`` when the model has
            only one.

    Raises:
        ModelChangeError: an outside model, no profile, an unknown profile,
            or several profiles and none named.
    """
    if model.is_external:
        raise ModelChangeError(f"{model.name} is served by an outside provider; nothing to scale.")
    if not model.profiles:
        raise ModelChangeError(f"{model.name} has no profile to scale.")
    names = [p.name for p in model.profiles]
    if profile is None:
        if len(model.profiles) > 1:
            raise ModelChangeError(
                f"{model.name} has several profiles ({', '.join(names)}); name one with "
                "'profile' (--profile).",
                param="profile",
            )
        profile = names[0]
    if profile not in names:
        raise ModelChangeError(
            f"{model.name} has no profile {profile!r}; it has {', '.join(names)}.",
            param="profile",
        )
    profiles = tuple(
        attrs.evolve(p, replicas=replicas) if p.name == profile else p for p in model.profiles
    )
    return attrs.evolve(model, profiles=profiles, stopped=False)


def change_context(
    model: ModelRecord,
    *,
    tokens: int | None,
    slots: int | None,
    max_output: int | None,
    profile: str | None = None,
) -> tuple[ModelRecord, bool]:
    """``model`` with a new context.

    ``tokens`` is a profile's ``context_tokens``: the engine's whole context
    (llama.cpp ``--ctx-size``), shared by ``slots`` parallel sequences, so
    one request gets ``tokens // slots``. Changing ``tokens`` or ``slots``
    changes the profile (every profile, or only ``profile``): the
    reconciler replaces the replicas one at a time, each successor Ready
    before its predecessor stops. Changing only ``max_output`` touches the
    catalog alone and applies at once.

    Returns:
        The new entry and whether its replicas must restart.

    Raises:
        ModelChangeError: nothing to change, an unknown profile, a
            per-request context beyond the trained one (``context_length``,
            when known), or ``max_output`` beyond the per-request context.
    """
    if tokens is None and slots is None and max_output is None:
        raise ModelChangeError("Give 'tokens', 'slots' or 'max_output'.")
    if model.is_external and (tokens is not None or slots is not None):
        raise ModelChangeError(f"{model.name} is an outside model: only 'max_output' can change.")
    if profile is not None and profile not in {p.name for p in model.profiles}:
        raise ModelChangeError(
            f"{model.name} has no profile {profile!r}; it has "
            f"{', '.join(p.name for p in model.profiles) or 'none'}.",
            param="profile",
        )
    profiles = []
    restart = False
    for p in model.profiles:
        if profile is not None and p.name != profile:
            profiles.append(p)
            continue
        new = attrs.evolve(
            p,
            context_tokens=p.context_tokens if tokens is None else tokens,
            slots=p.slots if slots is None else slots,
        )
        per_request = new.context_tokens // max(new.slots, 1)
        if model.context_length and per_request > model.context_length:
            raise ModelChangeError(
                f"{model.name}: {new.context_tokens} tokens over {new.slots} slots is "
                f"{per_request} per request, beyond the {model.context_length} it was trained "
                f"for; use at most {model.context_length * new.slots} tokens or more slots.",
                param="tokens",
            )
        restart = restart or new != p
        profiles.append(new)
    changed = attrs.evolve(model, profiles=tuple(profiles))
    if max_output is not None:
        changed = attrs.evolve(changed, max_output=max_output)
        limit = min(
            (p.context_tokens // max(p.slots, 1) for p in changed.profiles),
            default=changed.context_length,
        )
        if changed.context_length:
            limit = min(limit, changed.context_length) if limit else changed.context_length
        if limit and max_output > limit:
            raise ModelChangeError(
                f"{model.name}: max_output {max_output} is beyond the {limit} tokens one "
                "request may hold; raise the context first.",
                param="max_output",
            )
    return changed, restart


def local_facts(source: str) -> ModelFacts | None:
    """The shape of a model whose weights are readable here (enables the
    trained-context and KV-head checks), else ``None``. Only headers are
    read; blocking (run it in a thread)."""
    if not source or "://" in source or source.startswith("hf:"):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        return None
    try:
        return read_model_facts(path)
    except (PlanningError, OSError) as exc:
        log.info("cannot read the shape of %s (%s); checked without it", source, exc)
        return None


def check_model(model: ModelRecord, existing: Sequence[ModelRecord], *, new: bool) -> None:
    """Check ``model`` against the catalog rules, the rest of the catalog
    (``existing``) and, when its weights are readable here, their shape.
    Blocking (it may read a model file's header).

    Raises:
        CatalogError: the entry breaks a rule; the message names each problem.
    """
    validate_model(model, existing, new=new, facts=local_facts(model.source))


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return path != root


def purge_weights(model: ModelRecord, others: Sequence[ModelRecord], data_dir: Path) -> list[str]:
    """Delete ``model``'s weights from this control plane's data directory;
    the paths deleted. Blocking (run it in a thread).

    The entry's ``source``, when it is a local file or folder *inside*
    ``data_dir`` (symlinks resolved) that no other catalog entry's source
    (``others``) is, contains or lies in, is deleted. Anything outside the
    data directory (a ``--model`` file of yours) is never touched; remote
    sources (``hf:``, URLs) have no copy here. Copies on nodes go when their
    replicas stop (the agents' weights caches).

    Raises:
        OSError: the file or folder could not be deleted.
    """
    if not model.source or "://" in model.source or model.source.startswith("hf:"):
        return []
    root = data_dir.expanduser().resolve()
    target = Path(model.source).expanduser().resolve()
    if not _inside(target, root) or not target.exists():
        return []
    for other in others:
        if other.name == model.name or not other.source or "://" in other.source:
            continue
        theirs = Path(other.source).expanduser().resolve()
        if theirs == target or _inside(theirs, target) or _inside(target, theirs):
            log.info("purge of %s keeps %s: %s uses it", model.name, target, other.name)
            return []
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    log.info("purged %s of %s", target, model.name)
    return [str(target)]
