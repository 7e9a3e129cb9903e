"""The admin routes of models from a hub (``POST /api/v1/models/serve``,
``POST …/update``, ``GET /api/v1/weights``): what they store and how they
refuse. The hub itself is a seam here (``llmgw.control.hf.resolve``); it is
asked for real in ``tests/control/test_hf_models.py`` and end to end in
``tests/e2e/test_hf_serve.py``."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.control import hf
from llmgw.store import ModelRecord, Origin, OriginFile

C1 = "1" * 40
C2 = "2" * 40


def _resolved(commit: str, digest: str, *, extra: bool = False) -> hf.Resolved:
    files = [OriginFile(path="m.gguf", size_bytes=300_000_000, sha256=digest)]
    if extra:
        files.append(OriginFile(path="m.mmproj.gguf", size_bytes=10, sha256="e" * 64))
    origin = Origin(repo="org/m-gguf", revision=commit, files=tuple(files), main_file="m.gguf")
    return hf.Resolved(
        endpoint="http://mirror:8090",
        origin=origin,
        engine="llamacpp",
        files_seen=tuple((f.path, f.size_bytes) for f in files),
    )


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the seam is asked (ref, glob, engine) and answers (the next
    ``Resolved`` or exception, in order)."""
    answers: list[Any] = []
    asked: list[Any] = []

    def resolve(
        ref: hf.HfRef, settings: Any, *, glob: str | None = None, engine: str | None = None
    ) -> hf.Resolved:
        asked.append((ref, glob, engine))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, hf.Resolved)
        return answer

    monkeypatch.setattr(hf, "resolve", resolve)
    return [answers, asked]


async def test_serve_stores_the_pinned_origin(admin: Any, hub: list[Any]) -> None:
    answers, asked = hub
    answers.append(_resolved(C1, "a" * 64))
    status, body = await admin.call(
        "POST", "/api/v1/models/serve", {"source": "hf:org/m-gguf@main", "replicas": 2}
    )
    assert status == 201, body
    assert asked == [(hf.HfRef("org/m-gguf", "main"), None, None)]
    assert body["name"] == "m"
    assert body["entry"]["source"] == f"hf:org/m-gguf@{C1}/m.gguf"
    assert body["resolved"]["endpoint"] == "http://mirror:8090"
    stored = await admin.store.get_model("m")
    assert stored.origin == _resolved(C1, "a" * 64).origin
    profile = stored.profiles[0]
    assert (profile.engine, profile.replicas) == ("llamacpp", 2)
    assert profile.min_memory_gb > 0.3  # estimated from the file size
    answers.append(_resolved(C1, "a" * 64))
    status, body = await admin.call("POST", "/api/v1/models/serve", {"source": "hf:org/m-gguf"})
    assert status == 409, body
    assert body["error"]["code"] == "model_exists"


async def test_serve_refusals(admin: Any, hub: list[Any]) -> None:
    answers, asked = hub
    status, body = await admin.call("POST", "/api/v1/models/serve", {})
    assert status == 400
    assert body["error"]["param"] == "source"
    status, body = await admin.call("POST", "/api/v1/models/serve", {"source": "org/repo"})
    assert status == 400
    assert "hf:ORG/REPO" in body["error"]["message"]
    status, body = await admin.call(
        "POST", "/api/v1/models/serve", {"source": "hf:o/r", "replicas": -1}
    )
    assert status == 400
    assert not asked  # refused before the hub is asked
    answers.append(hf.HfError("pytorch_model.bin: a pickle format …", param="source"))
    status, body = await admin.call("POST", "/api/v1/models/serve", {"source": "hf:o/r"})
    assert status == 400
    assert "pickle" in body["error"]["message"]
    assert await admin.store.list_models() == []


async def test_update_pins_a_new_commit_and_says_what_changed(admin: Any, hub: list[Any]) -> None:
    answers, asked = hub
    answers.append(_resolved(C1, "a" * 64))
    status, _ = await admin.call(
        "POST", "/api/v1/models/serve", {"source": "hf:org/m-gguf", "name": "g"}
    )
    assert status == 201
    answers.append(_resolved(C2, "b" * 64, extra=True))
    status, body = await admin.call("POST", "/api/v1/models/g/update", {"revision": "v2"})
    assert status == 200, body
    assert asked[-1] == (hf.HfRef("org/m-gguf", "v2"), "m.gguf", "llamacpp")
    assert body["changes"] == {
        "from": C1,
        "to": C2,
        "added": ["m.mmproj.gguf"],
        "removed": [],
        "changed": ["m.gguf"],
    }
    assert body["restart"] is True
    stored = await admin.store.get_model("g")
    assert stored.source == f"hf:org/m-gguf@{C2}/m.gguf"
    answers.append(_resolved(C2, "b" * 64, extra=True))
    status, body = await admin.call("POST", "/api/v1/models/g/update", {})
    assert status == 200
    assert body["changes"]["from"] == body["changes"]["to"] == C2
    assert body["restart"] is False


async def test_update_of_a_model_without_origin_is_refused(admin: Any, hub: list[Any]) -> None:
    await admin.store.put_model(ModelRecord.simple("s", "sim"))
    status, body = await admin.call("POST", "/api/v1/models/s/update", {})
    assert status == 400
    assert "no pinned origin" in body["error"]["message"]
    status, body = await admin.call("POST", "/api/v1/models/nope/update", {})
    assert status == 404


async def test_weights_with_no_node(admin: Any) -> None:
    status, body = await admin.call("GET", "/api/v1/weights")
    assert status == 200
    assert body == {"nodes": []}
