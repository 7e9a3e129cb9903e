"""The portal's static files, served under content-hash names
(``/static/portal.<sha256[:12]>.css``) so a browser may keep them forever
and a new release is fetched at once. Everything is served by llmgw: no
third-party host."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Final

import attrs

__all__ = ["ASSETS", "Asset", "asset_url", "find_asset"]

_TYPES: Final = {"css": "text/css; charset=utf-8", "js": "text/javascript; charset=utf-8"}


@attrs.frozen
class Asset:
    """One static file: its hashed name, bytes and content type."""

    name: str
    hashed: str
    body: bytes
    content_type: str


def _load() -> dict[str, Asset]:
    found: dict[str, Asset] = {}
    folder = resources.files(__package__).joinpath("assets")
    for name in ("portal.css", "portal.js"):
        body = folder.joinpath(name).read_bytes()
        stem, _, ext = name.rpartition(".")
        digest = hashlib.sha256(body).hexdigest()[:12]
        found[name] = Asset(name, f"{stem}.{digest}.{ext}", body, _TYPES[ext])
    return found


#: The files by their plain name.
ASSETS: Final = _load()
_BY_HASHED: Final = {a.hashed: a for a in ASSETS.values()}


def asset_url(name: str) -> str:
    """``/static/<hashed name>`` of the file ``name`` (``KeyError`` if unknown)."""
    return "/static/" + ASSETS[name].hashed


def find_asset(hashed: str) -> Asset | None:
    """The file with this hashed name, or ``None``."""
    return _BY_HASHED.get(hashed)
