"""Admin routes of the guardrails (``docs/guardrails.md``).

- ``POST /api/v1/guard/judge/check`` ``{"model"?, "policy"?}``: times the
  judge (3 judgments in sequence, then a burst of 4) and says whether its
  ``latency_budget`` holds → :class:`llmgw.guard.judge.JudgeCheck` as JSON.
  The judge is ``model``'s, else the named policy's, else the first policy
  that names one; 400 when none does, 404 when the model is not in the
  catalog, 409 when it has no ready replica. It changes nothing.
"""

from __future__ import annotations

import itertools
from typing import Any, Final

import attrs
import httpx
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.control.cluster import Cluster
from llmgw.guard.judge import check_judge
from llmgw.settings import GuardJudge

from .errors import BadRequest, NoSuch
from .inputs import json_object

__all__ = ["add_guard_routes"]

#: Dialing a judge replica, seconds (the judgment's own deadline is the check's).
_CONNECT_S: Final = 5.0


class NotServed(errors.Refused):
    """The judge has no ready replica: 409 ``judge_not_ready``."""

    status = 409
    code = "judge_not_ready"


def _judge_for(cluster: Cluster, doc: dict[str, Any]) -> GuardJudge:
    settings = cluster.settings.guard
    model = doc.get("model")
    policy = doc.get("policy")
    if model is not None and not (isinstance(model, str) and model):
        raise BadRequest("'model' must be a model's name.")
    if policy is not None:
        if not isinstance(policy, str) or policy not in {*settings.policies, "baseline", "observe"}:
            raise BadRequest(f"No policy {policy!r}.")
        judge = settings.policy(policy).judge
    else:
        names = [*settings.default, *settings.policies]
        judges = [settings.policy(n).judge for n in names if settings.policy(n).judge.model]
        # With --model: the settings of a policy naming that model, else
        # the defaults (not another judge's format and budget).
        if model:
            judges = [j for j in judges if j.model == model]
        judge = judges[0] if judges else GuardJudge()
    if model:
        judge = attrs.evolve(judge, model=model)
    if not judge.model:
        raise BadRequest("No policy names a judge: give one with --model.")
    return judge


def add_guard_routes(app: QuartTrio, cluster: Cluster) -> None:
    """Add the routes of the module docstring to ``app``."""

    @app.post("/api/v1/guard/judge/check")
    async def judge_check() -> Any:
        judge = _judge_for(cluster, await json_object(allowed=("model", "policy")))
        found = cluster.models.get(judge.model) or next(
            (m for m in cluster.models.values() if judge.model in m.aliases), None
        )
        if found is None:
            raise NoSuch(f"No model {judge.model!r} in the catalog.")
        endpoints = cluster.ready_endpoints(found.name)
        if not endpoints:
            raise NotServed(f"The judge {found.name!r} has no ready replica.")
        turns = itertools.cycle(endpoints)

        async with httpx.AsyncClient(
            timeout=httpx.Timeout(judge.latency_budget * 2, connect=_CONNECT_S)
        ) as client:

            async def ask(model: str, body: dict[str, Any], tried: list[str]) -> str:
                endpoint = next(turns)
                scheme = "https" if endpoint.tls else "http"
                try:
                    answer = await client.post(
                        f"{scheme}://{endpoint.host}:{endpoint.port}{endpoint.path_prefix}"
                        "/v1/chat/completions",
                        json={**body, "model": found.name},
                        headers={k.decode(): v.decode() for k, v in endpoint.auth_headers},
                    )
                    content = answer.json()["choices"][0]["message"]["content"]
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                    raise errors.UpstreamError(f"the judge did not answer: {exc}") from exc
                if answer.status_code != 200 or not isinstance(content, str):
                    raise errors.UpstreamError(f"the judge answered {answer.status_code}")
                return content

            result = await check_judge(attrs.evolve(judge, model=found.name), ask)
        return attrs.asdict(result)
