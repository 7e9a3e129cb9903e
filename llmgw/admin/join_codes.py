"""Admin route of join codes (:mod:`llmgw.control.join`).

- ``POST /api/v1/nodes/join-codes`` ``{"expires_s": 3600, "labels": {…},
  "node_id": ""}`` (each optional) → ``{"code", "command": "llmgw join CODE",
  "expires_at", "node_id", "labels", "addresses"}``. The code works once,
  until ``expires_at`` (UTC epoch s); ``node_id`` ``""`` lets the node choose
  (its host name unless ``llmgw join --node-id``). 400 for a bad field; 409
  ``join_disabled`` on a control plane without a join port (``llmgw up``).
"""

from __future__ import annotations

from typing import Any, Final

from quart_trio import QuartTrio

from llmgw.control.join import MAX_CODE_EXPIRES_S, JoinService

from .errors import BadRequest, Clash
from .inputs import json_object

__all__ = ["DEFAULT_EXPIRES_S", "add_join_code_routes"]

#: How long a join code works unless the request says, in seconds.
DEFAULT_EXPIRES_S: Final = 3600


def add_join_code_routes(app: QuartTrio, join: JoinService | None) -> None:
    """Add the route of the module docstring to ``app``; ``join`` ``None``:
    the control plane has no join port."""

    @app.post("/api/v1/nodes/join-codes")
    async def make_join_code() -> Any:
        doc = await json_object(allowed=["expires_s", "labels", "node_id"])
        if join is None:
            raise Clash(
                "This control plane has no join port, so nodes cannot join it: run the control "
                "plane with `llmgw server` (join port 7444, --join-listen).",
                code="join_disabled",
            )
        expires_s = doc.get("expires_s", DEFAULT_EXPIRES_S)
        if (
            isinstance(expires_s, bool)
            or not isinstance(expires_s, int | float)
            or not 1 <= expires_s <= MAX_CODE_EXPIRES_S
        ):
            raise BadRequest(
                f"'expires_s' must be a number of seconds from 1 to {MAX_CODE_EXPIRES_S:.0f}.",
                param="expires_s",
            )
        node_id = doc.get("node_id") or ""
        if not isinstance(node_id, str):
            raise BadRequest("'node_id' must be a string.", param="node_id")
        labels = doc.get("labels") or {}
        made = await join.make_code(expires_s=float(expires_s), labels=labels, node_id=node_id)
        return {
            "code": made.code,
            "command": f"llmgw join {made.code}",
            "expires_at": made.expires_at,
            "node_id": made.node_id,
            "labels": made.labels,
            "addresses": list(made.addresses),
        }
