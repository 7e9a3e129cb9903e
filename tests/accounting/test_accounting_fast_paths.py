"""The per-request shortcuts of accounting give what the long way gives:
the journal's row encoding, the accountant's per-path plan, the limiter's
window roll, the key cache keyed by the secret, the recorder's bound
metric children."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import attrs
import orjson
import pytest

from llmgw import metrics
from llmgw.accounting.accountant import Accountant, RateLimited, ScopeLimits
from llmgw.accounting.journal import (
    UsageJournal,
    encode_row,
    read_records,
    read_segment,
    row_doc,
)
from llmgw.accounting.limiter import Limiter
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.auth.keys import KeyAuthenticator, KeyRefused, hash_key, new_key
from llmgw.gateway.recording import Recorder
from llmgw.gateway.request import Outcome, Request
from llmgw.gateway.sse import Usage
from llmgw.store import KeyRecord, UsageRow

NOW = dt.datetime(2026, 3, 1, 12, 0, 10, tzinfo=dt.UTC).timestamp()


def _rows() -> list[UsageRow]:
    return [
        UsageRow(request_id="req_a", created_at=NOW, key_id="k", model="m", status=200),
        UsageRow(
            request_id="req_b",
            created_at=NOW + 0.125,
            key_id="k",
            model="m",
            status=503,
            prompt_tokens=12,
            cached_tokens=3,
            completion_tokens=40,
            duration_ms=12.5,
            ttft_ms=None,
            replica_id="r1",
            stream=True,
            endpoint="chat",
            project_id="p",
            team_id="t",
            org_id="o",
            served_model="other",
            cost_micros=99,
            cache_hit=True,
            guard_rules="a,b",
            guard_action="mask",
            guard_ms=0.25,
            guard_events=[("input", "a", "flag"), ("output", "b", "mask")],
        ),
    ]


@pytest.mark.parametrize("row", _rows())
def test_a_row_is_encoded_byte_for_byte_as_attrs_asdict_would(row: UsageRow) -> None:
    assert orjson.dumps(row_doc(row)) == orjson.dumps(attrs.asdict(row))
    assert list(row_doc(row)) == [field.name for field in attrs.fields(UsageRow)]


async def test_rows_written_with_the_fast_encoding_read_back_equal(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "j")
    for row in _rows():
        journal.append(row)
    journal.close()
    (segment,) = sorted((tmp_path / "j").glob("*.seg"))
    assert read_segment(segment) == _rows()
    assert segment.read_bytes() == b"".join(encode_row(row) for row in _rows())


async def test_a_segment_read_for_its_rows_skips_the_started_records(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "j")
    first, second = _rows()
    journal.begin(first.request_id, lambda: attrs.evolve(first, status=503))
    journal.begin(second.request_id, lambda: attrs.evolve(second, status=503))
    journal.append(first)
    journal.close()
    (segment,) = sorted((tmp_path / "j").glob("*.seg"))
    assert read_segment(segment) == [first]
    rows, starts = read_records(segment)
    assert rows == [first]
    assert starts == [attrs.evolve(first, status=503), attrs.evolve(second, status=503)]
    assert read_records(segment, starts=False) == ([first], [])


def test_a_window_rolls_at_the_minutes_edge_and_not_before() -> None:
    limiter = Limiter()
    minute = 60.0 * 10_000
    limiter.charge("c", 6, minute)
    assert limiter.rate("c", minute + 59.999) == 6
    # The next minute: this minute's count weighs less as the minute passes.
    assert limiter.rate("c", minute + 60) == pytest.approx(6)
    assert limiter.rate("c", minute + 90) == pytest.approx(3)
    assert limiter.rate("c", minute + 120) == 0


def _tuple_path(rpm: int | None = None) -> tuple[ScopeLimits, ...]:
    return (
        ScopeLimits("key:k1", rpm=rpm),
        ScopeLimits("project:p_1"),
        ScopeLimits("team:t_1", tpm=1_000),
        ScopeLimits("org:o_1"),
    )


def test_a_path_tuple_reused_is_limited_exactly_as_a_fresh_one() -> None:
    cached = Accountant(PriceBook({}), default_rpm=None, default_tpm=None)
    fresh = Accountant(PriceBook({}), default_rpm=None, default_tpm=None)
    path = _tuple_path(rpm=3)
    for n in range(4):
        outcomes: list[object] = []
        for acc, p in ((cached, path), (fresh, list(_tuple_path(rpm=3)))):
            try:
                reservation = acc.check(p, "m", 100, NOW + n)
            except RateLimited as exc:
                outcomes.append(("refused", exc.scope, exc.retry_after_s))
            else:
                outcomes.append(
                    (
                        reservation.scopes,
                        reservation.request_counters,
                        reservation.token_counters,
                        reservation.headers(),
                    )
                )
        assert outcomes[0] == outcomes[1]
    last = outcomes[0]
    # The fourth request of a 3 rpm key.
    assert isinstance(last, tuple)
    assert last[:2] == ("refused", "key:k1")


def test_a_changed_default_applies_to_a_path_tuple_seen_before() -> None:
    acc = Accountant(PriceBook({}), default_rpm=None, default_tpm=None)
    path = (ScopeLimits("key:k1"),)
    assert acc.check(path, "m", 10, NOW).request_counters == ()
    acc.default_rpm = 1
    assert acc.check(path, "m", 10, NOW).request_counters == ("key:k1",)
    with pytest.raises(RateLimited):
        acc.check(path, "m", 10, NOW)


class _OneKeyStore:
    """A store seam holding one key; counts the look-ups."""

    def __init__(self, record: KeyRecord) -> None:
        self.record = record
        self.lookups = 0

    async def find_key_by_hash(self, digest: str) -> KeyRecord | None:
        self.lookups += 1
        return self.record if digest == self.record.key_hash else None


async def test_the_key_cache_is_keyed_by_the_whole_secret() -> None:
    secret, record = new_key("k")
    store = _OneKeyStore(record)
    auth = KeyAuthenticator(store, cache_ttl_s=60)  # type: ignore[arg-type]
    assert await auth.check(secret) == record
    assert await auth.check(secret) == record
    assert store.lookups == 1
    # Another secret, even sharing all but the last character, is looked up.
    other = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    assert hash_key(other) != record.key_hash
    with pytest.raises(KeyRefused):
        await auth.check(other)
    assert store.lookups == 2
    auth.forget(record.id)
    assert await auth.check(secret) == record
    assert store.lookups == 3


async def test_a_long_secret_is_cached_by_its_digest() -> None:
    _, record = new_key("k")
    long_secret = "sk-llmgw-" + "x" * 5000
    store = _OneKeyStore(attrs.evolve(record, key_hash=hash_key(long_secret)))
    auth = KeyAuthenticator(store, cache_ttl_s=60)  # type: ignore[arg-type]
    assert (await auth.check(long_secret)).id == record.id
    assert (await auth.check(long_secret)).id == record.id
    assert store.lookups == 1
    assert list(auth._cache) == [hash_key(long_secret)]
    auth.forget(record.id)
    assert not auth._cache


def _sample(name: str, labels: dict[str, str]) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_the_recorder_counts_each_label_and_status_with_bound_children(
    tmp_path: Path,
) -> None:
    journal = UsageJournal(tmp_path / "j")
    recorder = Recorder(usage=UsageWriter(journal=journal), accountant=None, accounting=True)
    _, key = new_key("k")
    model = "fast-path-model"
    before = {
        status: _sample("llmgw_requests_total", {"model": model, "status": status})
        for status in ("200", "429")
    }
    tokens_before = _sample("llmgw_tokens_total", {"model": model, "direction": "completion"})
    cached_before = _sample("llmgw_tokens_total", {"model": model, "direction": "cached"})
    for n, status in enumerate((200, 200, 429)):
        outcome = Outcome()
        outcome.usage = Usage(prompt_tokens=5, completion_tokens=7) if status == 200 else None
        outcome.finish(status)
        request = Request(kind="chat", request_id=f"req_fp_{n}", started=0.0, key=key, model=model)
        assert recorder.record(request, outcome, {model}) is None
    assert _sample("llmgw_requests_total", {"model": model, "status": "200"}) == before["200"] + 2
    assert _sample("llmgw_requests_total", {"model": model, "status": "429"}) == before["429"] + 1
    completion = _sample("llmgw_tokens_total", {"model": model, "direction": "completion"})
    assert completion == tokens_before + 14
    assert _sample("llmgw_tokens_total", {"model": model, "direction": "cached"}) == cached_before
    journal.close()
    (segment,) = sorted((tmp_path / "j").glob("*.seg"))
    rows = read_segment(segment)
    assert [(r.request_id, r.status, r.completion_tokens) for r in rows] == [
        ("req_fp_0", 200, 7),
        ("req_fp_1", 200, 7),
        ("req_fp_2", 429, 0),
    ]
    assert all(r.created_at > NOW and r.model == model for r in rows)
