"""The portal lists only the models a person may call, against a real
``llmgw up --engine sim`` with two models: the person's project allows one;
the Chat and Models pages leave the other out, and the session's chat key is
refused it (403) while another key may call it (``docs/portal.md``)."""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import openai
import pytest

if TYPE_CHECKING:
    from tests.e2e.portal_helpers import MODEL, Portal, running_portal, wait
else:  # tests is no package: pytest puts this folder on sys.path
    from portal_helpers import MODEL, Portal, running_portal, wait

pytestmark = pytest.mark.slow

OTHER = "sim-other"


@pytest.fixture(scope="module")
def portal(
    tmp_path_factory: pytest.TempPathFactory, up_argv: Callable[..., list[str]]
) -> Iterator[Portal]:
    data_dir = tmp_path_factory.mktemp("portal-models") / "data"
    with running_portal(
        data_dir, up_argv(data_dir, "--engine", "sim", "--model-name", MODEL)
    ) as up:
        yield up
        up.close_browsers()


def _ask(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    return answer.choices[0].message.content or ""


def test_a_model_outside_the_projects_list_is_neither_listed_nor_callable(portal: Portal) -> None:
    added = portal.admin_api(
        "POST",
        "/api/v1/models",
        {
            "name": OTHER,
            "profiles": [{"name": "default", "engine": "sim", "min_memory_gb": 0.1}],
        },
    )
    assert added.status_code == 201, added.text
    wait(
        lambda: portal.admin_api("GET", f"/api/v1/models/{OTHER}").json()["replicas"]["ready"] >= 1,
        120,
        f"{OTHER} ready",
    )
    password = portal.join("only@example.com", "Acme/ml/only")
    limited = portal.admin_api("PUT", "/api/v1/limits/project/Acme/ml/only", {"models": [MODEL]})
    assert limited.status_code == 200, limited.text

    # Another key (personal: no models list) may call both models.
    made = portal.admin_api("POST", "/api/v1/keys", {"name": "free", "person": "x@example.com"})
    assert made.status_code == 201, made.text
    free = openai.OpenAI(base_url=f"{portal.base}/v1", api_key=made.json()["key"], max_retries=0)
    portal.closing.append(free)
    assert _ask(free, OTHER)
    assert _ask(free, MODEL)

    browser = portal.browser()
    assert browser.sign_in("only@example.com", password).status_code == 303
    chat = browser.http.get("/portal/chat")
    assert chat.status_code == 200
    assert f'value="{MODEL}"' in chat.text or f">{MODEL}<" in chat.text, chat.text
    assert OTHER not in chat.text
    models = browser.http.get("/portal/models").text
    assert MODEL in models
    assert OTHER not in models

    found = re.search(r'data-key="([^"]+)"', chat.text)
    assert found is not None
    client = openai.OpenAI(
        base_url=f"{portal.base}/v1", api_key=html.unescape(found.group(1)), max_retries=0
    )
    portal.closing.append(client)
    assert _ask(client, MODEL)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _ask(client, OTHER)
    assert "model_not_allowed" in str(refused.value) or OTHER in str(refused.value)
    listed = [m.id for m in client.models.list()]
    assert MODEL in listed
    assert OTHER not in listed
