"""Outside-provider keys read from files, one endpoint per key."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from llmgw.router.breaker import BreakerState
from llmgw.router.external import ExternalKeyFile, ProviderKeys, parse_provider_url


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_provider_urls() -> None:
    assert parse_provider_url("https://api.x.com") == ("api.x.com", 443, True, "")
    assert parse_provider_url("http://127.0.0.1:8001") == ("127.0.0.1", 8001, False, "")
    assert parse_provider_url("https://host:8443/openai/") == ("host", 8443, True, "/openai")
    assert parse_provider_url("http://[::1]:9000") == ("::1", 9000, False, "")
    assert parse_provider_url("http://h") == ("h", 80, False, "")
    for bad, message in [
        ("ftp://x", "http:// or https://"),
        ("api.x.com", "http:// or https://"),
        ("https://", "no host"),
        ("https://u:p@x", "credentials"),
        ("https://x/?a=1", "query"),
        ("https://x:99999", "not valid"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_provider_url(bad)


def test_one_endpoint_per_key_named_by_position_with_its_weight(tmp_path: Path) -> None:
    keys = ProviderKeys(
        "gpt",
        "https://api.example.com/v1beta",
        [
            ExternalKeyFile(write(tmp_path / "a", "sk-a\n"), 0),
            (write(tmp_path / "b", "  sk-b  "), 3),
        ],
    )
    first, second = keys.refresh(0.0)
    assert (first.replica_id, first.label, first.api_key, first.weight) == (
        "external:gpt#1",
        "external:gpt#1",
        "sk-a",
        1,
    )
    assert (second.replica_id, second.api_key, second.weight) == ("external:gpt#2", "sk-b", 3)
    assert first.external
    assert first.tls
    assert (first.host, first.port, first.path_prefix) == ("api.example.com", 443, "/v1beta")
    assert first.model == "gpt"
    assert first.slots == 0
    assert first.auth_headers == [(b"authorization", b"Bearer sk-a")]


def test_a_key_replaced_on_disk_takes_effect_on_refresh_in_the_same_endpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "key"
    keys = ProviderKeys("m", "http://127.0.0.1:8001", [(write(path, "old-key"), 1)])
    [endpoint] = keys.refresh(0.0)
    endpoint.in_flight = 2
    endpoint.breaker.failure(0.0, status=429)
    write(path, "new-key-longer")
    assert keys.refresh(0.5) == [endpoint]
    assert endpoint.api_key == "old-key"  # looked at once a second at most
    [again] = keys.refresh(1.0)
    assert again is endpoint
    assert endpoint.api_key == "new-key-longer"
    assert endpoint.in_flight == 2
    assert endpoint.breaker.state is BreakerState.CLOSED  # a new key starts afresh
    # Unchanged file: the same object, breaker kept.
    endpoint.breaker.failure(1.0, status=429)
    [same] = keys.refresh(2.0)
    assert same is endpoint
    assert same.breaker.state is BreakerState.OPEN


def test_a_same_size_replacement_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "key"
    keys = ProviderKeys("m", "http://h", [(write(path, "aaaa"), 1)])
    [endpoint] = keys.refresh(0.0)
    replacement = tmp_path / "key.new"
    write(replacement, "bbbb")
    os.replace(replacement, path)  # how keys are rotated: a new inode
    keys.refresh(5.0)
    assert endpoint.api_key == "bbbb"


def test_unreadable_or_empty_key_files_are_dropped_and_logged_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = write(tmp_path / "good", "sk-good-secret")
    empty = write(tmp_path / "empty", " \n")
    keys = ProviderKeys("m", "http://h", [(good, 1), (str(tmp_path / "missing"), 1), (empty, 1)])
    with caplog.at_level(logging.WARNING, logger="llmgw.router"):
        [only] = keys.refresh(0.0)
        keys.refresh(10.0)  # still broken: not logged again
    assert only.replica_id == "external:m#1"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert any("external:m#2" in m and "cannot be read" in m for m in messages)
    assert any("external:m#3" in m and "empty" in m for m in messages)
    assert not any("sk-good-secret" in m for m in messages)
    # The missing key appears: it becomes #2, keeping its position.
    write(tmp_path / "missing", "sk-late")
    endpoints = keys.refresh(20.0)
    assert [e.replica_id for e in endpoints] == ["external:m#1", "external:m#2"]


def test_a_key_that_becomes_unreadable_is_dropped_and_its_model_withdrawn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "key"
    keys = ProviderKeys("m", "http://h", [(write(path, "sk"), 1)])
    [endpoint] = keys.refresh(0.0)
    path.unlink()
    assert keys.refresh(1.0) == []
    write(path, "sk")
    assert keys.refresh(2.0) == [endpoint]  # the same endpoint comes back


def test_bad_key_lists_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no key file"):
        ProviderKeys("m", "http://h", [])
    with pytest.raises(ValueError, match="weight"):
        ProviderKeys("m", "http://h", [(str(tmp_path / "k"), -1)])
    with pytest.raises(ValueError, match="http"):
        ProviderKeys("m", "api.example.com", [(str(tmp_path / "k"), 1)])
