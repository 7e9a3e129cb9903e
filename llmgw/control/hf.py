"""Models from Hugging Face (or a mirror of it), pinned to a commit
(``docs/models-from-hf.md``).

``ctl model serve hf:ORG/REPO[@REV]`` and ``ctl model update NAME`` come
here through the admin API: :func:`resolve` asks the hub (the first of the
settings' ``mirrors`` that answers, then ``weights.hf_endpoint``, the
control plane's ``HF_ENDPOINT``, or ``https://huggingface.co``) for the
revision's commit and its files with their sizes and the LFS sha256 the hub
publishes, picks the files and the engine (:func:`choose_files`: a GGUF →
``llamacpp``, safetensors → ``vllm``), and refuses pickle formats before any
byte of weights is fetched. :func:`diff_origins` says what an update changes.

Blocking (``huggingface_hub`` and httpx, synchronous): run it in a thread.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx

from llmgw import errors
from llmgw.settings import ServerSettings
from llmgw.store import Origin, OriginFile

__all__ = [
    "DEFAULT_HF_ENDPOINT",
    "HfError",
    "HfRef",
    "Resolved",
    "choose_files",
    "default_name",
    "diff_origins",
    "endpoints",
    "estimated_memory_gb",
    "is_split_gguf",
    "origin_source",
    "parse_hf_source",
    "resolve",
    "serve_entry",
]

log = logging.getLogger("llmgw.control.hf")

DEFAULT_HF_ENDPOINT: Final = "https://huggingface.co"
#: Deadline of each call to a hub, in seconds.
HUB_TIMEOUT_S: Final = 10.0
#: Deadline of the probe that finds the first mirror answering, in seconds.
PROBE_TIMEOUT_S: Final = 3.0
#: Small files the hub publishes no sha256 for (config, tokenizer) are read
#: and hashed here when at most this big, in bytes.
SMALL_FILE_BYTES: Final = 16 * 1024 * 1024
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")
#: Files a vLLM model directory takes besides its safetensors (never code).
_VLLM_EXTRAS: Final = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
_REPO: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT: Final = re.compile(r"^[0-9a-f]{40}$")
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")
_SPLIT_GGUF: Final = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class HfError(errors.InvalidInput):
    """A model from a hub cannot be served as asked: a bad ``hf:`` source,
    an unknown repository or revision, a pickle format, no file to run, no
    hub answering. The message says which and what to do.

    Attributes:
        param: the request field at fault, or ``None``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen
class HfRef:
    """``hf:ORG/REPO[@REV]``: the repository and the revision asked for
    (``None`` = ``main``)."""

    repo: str
    revision: str | None = None


def parse_hf_source(text: str) -> HfRef:
    """The :class:`HfRef` of ``hf:ORG/REPO[@REV]``.

    Raises:
        HfError: not of that form.
    """
    body = text.strip()
    if not body.startswith("hf:"):
        raise HfError(f"{text!r} is not hf:ORG/REPO[@REVISION]", param="source")
    body = body[3:]
    repo, at, revision = body.partition("@")
    if not _REPO.match(repo) or ".." in repo:
        raise HfError(f"{text!r}: {repo!r} is not ORG/REPO", param="source")
    if at and not re.fullmatch(r"[A-Za-z0-9._/-]{1,200}", revision):
        raise HfError(f"{text!r}: {revision!r} is not a revision", param="source")
    return HfRef(repo=repo, revision=revision or None)


def endpoints(settings: ServerSettings, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The hubs to ask, in order: the ``mirrors``, then ``weights.hf_endpoint``,
    else ``HF_ENDPOINT`` of ``environ`` (this process's environment by
    default), else :data:`DEFAULT_HF_ENDPOINT`."""
    env = os.environ if environ is None else environ
    hub = settings.weights.hf_endpoint or env.get("HF_ENDPOINT", "") or DEFAULT_HF_ENDPOINT
    out: list[str] = []
    for url in (*settings.mirrors, hub):
        url = url.rstrip("/")
        if url not in out:
            out.append(url)
    return tuple(out)


def _token(settings: ServerSettings) -> str | None:
    path = settings.weights.token_file
    if not path:
        return None
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise HfError(
            f"weights.token_file {path}: cannot read the Hugging Face token: {exc.strerror or exc}"
        ) from None
    return token or None


def _first_answering(hubs: Sequence[str], repo: str, transport: Any = None) -> str:
    """The first hub that answers an HTTP request at all (any status); a hub
    whose URL cannot be used (``http://[::1``) counts as not answering.

    Raises:
        HfError: no hub answers.
    """
    tried: list[str] = []
    with httpx.Client(timeout=PROBE_TIMEOUT_S, transport=transport) as client:
        for hub in hubs:
            try:
                client.get(f"{hub}/api/models/{repo}")
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                tried.append(f"{hub}: {errors.describe(exc)}")
                continue
            return hub
    raise HfError("no hub answers: " + "; ".join(tried))


@attrs.frozen
class Resolved:
    """What :func:`resolve` found.

    Attributes:
        endpoint: the hub that answered.
        origin: repository, commit, the files chosen and the main file.
        engine: the engine chosen (or the one asked for).
        files_seen: every file of the commit, by path, with its size.
    """

    endpoint: str
    origin: Origin
    engine: str
    files_seen: tuple[tuple[str, int], ...]


def choose_files(
    siblings: Sequence[tuple[str, int, str]], *, glob: str | None, engine: str | None
) -> tuple[str, list[tuple[str, int, str]], str]:
    """Pick from a commit's files (``(path, size_bytes, lfs_sha256 or "")``):
    the engine, the files to fetch, the main file ("" = the directory).

    - ``glob`` (``--file``) narrows to the files it matches (``fnmatch``);
    - a pickle format among the files chosen is refused, and so is a
      repository holding nothing but pickle weights;
    - GGUF → ``llamacpp``: one file (or the parts of one split GGUF); more
      than one needs ``--file``;
    - safetensors → ``vllm``: every ``*.safetensors`` plus the config and
      tokenizer files (never code: no ``*.py``).

    Raises:
        HfError: nothing matches, a pickle format, several GGUF files,
            an engine that cannot run the format.
    """
    paths = [s[0] for s in siblings]
    chosen = [s for s in siblings if glob is None or fnmatch.fnmatch(s[0], glob)]
    if glob is not None and not chosen:
        raise HfError(
            f"--file {glob} matches none of the files: {', '.join(paths[:30])}", param="file"
        )
    pickles = [s[0] for s in chosen if s[0].lower().endswith(PICKLE_SUFFIXES)]
    ggufs = [s for s in chosen if s[0].lower().endswith(".gguf")]
    tensors = [s for s in chosen if s[0].lower().endswith(".safetensors")]
    if glob is not None and pickles:
        raise HfError(
            f"{', '.join(pickles)}: a pickle format (.bin, .pt, .pth, .pkl, .ckpt) can run "
            "code when loaded; refused before anything was downloaded",
            param="file",
        )
    if not ggufs and not tensors:
        if pickles:
            raise HfError(
                f"the repository holds its weights only in pickle formats ({', '.join(pickles)}), "
                "which can run code when loaded; refused before anything was downloaded. "
                "Look for a GGUF or safetensors version of it.",
                param="source",
            )
        raise HfError(
            "no GGUF or safetensors file to serve among: " + ", ".join(paths[:30]), param="file"
        )
    if ggufs and (engine in (None, "llamacpp") or not tensors):
        groups: dict[str, list[tuple[str, int, str]]] = {}
        for s in ggufs:
            split = _SPLIT_GGUF.search(s[0])
            key = s[0][: split.start()] if split else s[0]
            groups.setdefault(key, []).append(s)
        if len(groups) > 1:
            raise HfError(
                "several GGUF files; choose one with --file: " + ", ".join(sorted(groups)),
                param="file",
            )
        files = sorted(next(iter(groups.values())))
        return engine or "llamacpp", files, files[0][0]
    extras = [s for s in siblings if Path(s[0]).name in _VLLM_EXTRAS and "/" not in s[0]]
    files = sorted({*tensors, *extras})
    return engine or "vllm", files, ""


def _hash_small(client: httpx.Client, url: str, size: int) -> str:
    if size > SMALL_FILE_BYTES:
        raise HfError(f"{url}: {size} bytes and no sha256 published; cannot pin it")
    response = client.get(url)
    if response.status_code != 200:
        raise HfError(f"{url}: HTTP {response.status_code}")
    return hashlib.sha256(response.content).hexdigest()


def resolve(
    ref: HfRef,
    settings: ServerSettings,
    *,
    glob: str | None = None,
    engine: str | None = None,
    environ: dict[str, str] | None = None,
    transport: Any = None,
) -> Resolved:
    """Resolve ``ref`` to a commit and the files to serve (module docstring).

    Only the hub's API is asked (and small config files without a published
    sha256 read, for a safetensors model); no weights are fetched.

    Raises:
        HfError: no hub answers, the repository or revision is unknown (or
            gated without a token), a pickle format, nothing to serve.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hubs = endpoints(settings, environ)
    hub = _first_answering(hubs, ref.repo, transport)
    token = _token(settings)
    api = HfApi(endpoint=hub, token=token or False)
    revision = ref.revision or "main"
    try:
        info = api.model_info(
            ref.repo, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_S
        )
    except GatedRepoError:
        raise HfError(
            f"{ref.repo} on {hub} is gated: accept its terms on the hub and set "
            "weights.token_file to a file holding a token",
            param="source",
        ) from None
    except RevisionNotFoundError:
        raise HfError(f"{ref.repo} on {hub} has no revision {revision!r}", param="source") from None
    except RepositoryNotFoundError:
        raise HfError(f"{hub} has no repository {ref.repo}", param="source") from None
    except HfHubHTTPError as exc:
        raise HfError(f"{hub}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:  # not the hub's shape
        raise HfError(
            f"{hub} answered {ref.repo}@{revision} with something that is not a model's info "
            f"({type(exc).__name__}: {exc})"
        ) from None
    commit = str(info.sha or "")
    if not _COMMIT.match(commit):
        raise HfError(f"{hub} gave no commit for {ref.repo}@{revision}")
    siblings: list[tuple[str, int, str]] = []
    for s in info.siblings or ():
        sha = str(s.lfs.sha256).lower() if s.lfs is not None and s.lfs.sha256 else ""
        size = int(s.lfs.size if s.lfs is not None and s.lfs.size else (s.size or 0))
        siblings.append((s.rfilename, size, sha))
    engine_name, chosen, main_file = choose_files(siblings, glob=glob, engine=engine)
    files: list[OriginFile] = []
    with httpx.Client(timeout=HUB_TIMEOUT_S, transport=transport, follow_redirects=True) as client:
        for path, size, sha in chosen:
            if not _SHA256.match(sha):
                sha = _hash_small(client, f"{hub}/{ref.repo}/resolve/{commit}/{path}", size)
            files.append(OriginFile(path=path, size_bytes=size, sha256=sha))
    origin = Origin(repo=ref.repo, revision=commit, files=tuple(files), main_file=main_file)
    log.info(
        "%s@%s is commit %s on %s: %d files, %.2f GB, engine %s",
        ref.repo,
        revision,
        commit,
        hub,
        len(files),
        sum(f.size_bytes for f in files) / 1e9,
        engine_name,
    )
    return Resolved(
        endpoint=hub,
        origin=origin,
        engine=engine_name,
        files_seen=tuple((p, size) for p, size, _ in siblings),
    )


def origin_source(origin: Origin) -> str:
    """The catalog ``source`` of ``origin``: ``hf:ORG/REPO@<commit>/<main_file>``,
    or ``hf:ORG/REPO@<commit>`` for a directory model."""
    base = f"hf:{origin.repo}@{origin.revision}"
    return f"{base}/{origin.main_file}" if origin.main_file else base


def diff_origins(old: Origin | None, new: Origin) -> dict[str, Any]:
    """What changes from ``old`` to ``new``: ``{"from", "to", "added",
    "removed", "changed"}`` (file paths; changed = another sha256 or size)."""
    before = {f.path: f for f in old.files} if old is not None else {}
    after = {f.path: f for f in new.files}
    return {
        "from": old.revision if old is not None else "",
        "to": new.revision,
        "added": sorted(set(after) - set(before)),
        "removed": sorted(set(before) - set(after)),
        "changed": sorted(
            p
            for p in set(before) & set(after)
            if (before[p].sha256, before[p].size_bytes) != (after[p].sha256, after[p].size_bytes)
        ),
    }


def default_name(repo: str, main_file: str) -> str:
    """A catalog name for a served repository: its name, lowercase, less a
    trailing ``-gguf`` (``llmgw/gemma-3-270m-gguf`` → ``gemma-3-270m``)."""
    name = repo.split("/", 1)[1].lower()
    for suffix in ("-gguf", "_gguf", ".gguf"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or repo.split("/", 1)[1]


def estimated_memory_gb(weights_bytes: int, context_tokens: int) -> float:
    """Host memory to reserve for a llama.cpp replica from the weights' size
    alone (nothing of the file is read before it reaches a node): the
    weights, llama.cpp's overhead (0.5 GiB + 1/50 of the weights) and a
    KV allowance of 64 KiB per context token, rounded up to a tenth of a GB."""
    need = weights_bytes * 1.02 + 0.5 * 2**30 + 65536 * max(context_tokens, 0)
    return float(int(need / 1e8) + 1) / 10


def serve_entry(
    resolved: Resolved,
    *,
    name: str,
    replicas: int = 1,
    context_tokens: int = 4096,
    slots: int = 4,
    cpu_cores: int = 0,
    min_memory_gb: float | None = None,
    gpu_class: str = "",
    gpus: int = 0,
    args: Sequence[str] = (),
) -> dict[str, Any]:
    """The catalog entry (the admin API's form) for a resolved model: its
    ``source`` (:func:`origin_source`), ``origin`` and one profile
    ``default`` for the engine chosen. A vLLM profile needs a ``gpu_class``
    (one card unless ``gpus``); a llama.cpp one on CPU gets
    :func:`estimated_memory_gb` unless ``min_memory_gb`` is given."""
    origin = resolved.origin
    weights = sum(f.size_bytes for f in origin.files)
    profile: dict[str, Any] = {
        "name": "default",
        "engine": resolved.engine,
        "replicas": replicas,
        "context_tokens": context_tokens,
        "slots": slots,
    }
    if cpu_cores:
        profile["cpu_cores"] = cpu_cores
    if gpu_class:
        profile["gpu_class"] = gpu_class
        profile["gpus"] = max(gpus, 1)
    if args:
        profile["args"] = list(args)
    if min_memory_gb is not None:
        profile["min_memory_gb"] = min_memory_gb
    elif not gpu_class:
        profile["min_memory_gb"] = estimated_memory_gb(weights, context_tokens)
    return {
        "name": name,
        "source": origin_source(origin),
        "origin": attrs.asdict(origin),
        "profiles": [profile],
    }


def is_split_gguf(path: str) -> bool:
    """``path`` is one part of a split GGUF (``…-00001-of-00003.gguf``)."""
    return _SPLIT_GGUF.search(path) is not None
