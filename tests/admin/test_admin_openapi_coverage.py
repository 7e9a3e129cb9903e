"""``docs/openapi/admin.yaml`` names every route of the admin app and no
route it does not have, so the document schemathesis checks
(tests/e2e/test_openapi.py) is the whole API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from tests.admin.conftest import Admin

ADMIN_YAML = Path(__file__).resolve().parents[2] / "docs" / "openapi" / "admin.yaml"
#: Methods every route answers by itself (quart adds them).
_IMPLICIT = {"HEAD", "OPTIONS"}


def _documented() -> set[tuple[str, str]]:
    doc = yaml.safe_load(ADMIN_YAML.read_text())
    return {
        (method.upper(), path)
        for path, operations in doc["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    }


def _served(admin: Admin) -> set[tuple[str, str]]:
    routes = set()
    for rule in admin.app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        # /api/v1/models/<name> and <path:project> are {name} and {project}.
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        routes |= {(method, path) for method in rule.methods or () if method not in _IMPLICIT}
    return routes


async def test_the_document_names_every_admin_route_and_no_other(admin: Admin) -> None:
    served, documented = _served(admin), _documented()
    assert served - documented == set(), "routes missing from admin.yaml"
    assert documented - served == set(), "admin.yaml names routes the app has not"
    assert ("DELETE", "/api/v1/models/{name}") in served
