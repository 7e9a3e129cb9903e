"""The live settings loop (``llmgw.control.live``) under trio's mock clock.

The store here is an in-memory stand-in for the settings methods of
:class:`llmgw.store.Store` (the SQLite ones are covered by the store
contract suite), so the clock only moves when the loop sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import attrs
import pytest
import trio

from llmgw.control.cluster import Cluster
from llmgw.control.live import POLL_S, LiveSettings, serve_settings
from llmgw.settings import (
    OnDemandSettings,
    ServerSettings,
    ServingSettings,
    SettingsError,
    changed_keys,
    check_doc_keys,
    check_key_path,
    settings_from_doc,
    settings_to_doc,
    with_key,
)
from llmgw.store import Conflict, Store, StoreError
from llmgw.store.records import SettingChange


class SettingsStore:
    """The settings methods of a store, in memory; ``failing`` makes every
    call raise :class:`StoreError`; ``calls`` counts them."""

    def __init__(self) -> None:
        self.history: list[SettingChange] = []
        self.failing = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.failing:
            raise StoreError("the store is down")

    async def get_settings_doc(self) -> tuple[int, dict[str, Any]] | None:
        self._check()
        if not self.history:
            return None
        last = self.history[-1]
        return last.version, dict(last.document)

    async def put_settings_doc(
        self,
        doc: Mapping[str, Any],
        *,
        expected_version: int | None,
        actor: str,
        note: str = "",
        fence: Any = None,
    ) -> int:
        self._check()
        current = len(self.history)
        if expected_version is not None and expected_version != current:
            raise Conflict(f"version {current} is live, not {expected_version}")
        change = SettingChange(
            version=current + 1,
            document=dict(doc),
            changed_at=trio.current_time(),
            actor=actor,
            note=note,
        )
        self.history.append(change)
        return change.version

    async def settings_version(self) -> int:
        self._check()
        return len(self.history)

    def write(self, doc: Mapping[str, Any], actor: str = "elsewhere") -> int:
        """Another control plane's write, straight into the history."""
        version = len(self.history) + 1
        self.history.append(
            SettingChange(version=version, document=dict(doc), changed_at=0.0, actor=actor)
        )
        return version


def stopped_doc(stopped: bool = True) -> dict[str, Any]:
    return settings_to_doc(ServerSettings(serving=ServingSettings(stopped=stopped)))


SEED = ServerSettings(on_demand=OnDemandSettings(evict_after_idle=45.0))


async def start_loop(
    nursery: trio.Nursery,
    fake: SettingsStore,
    cluster: Cluster,
    seed: ServerSettings = SEED,
    source: str | None = "server.yaml",
) -> LiveSettings:
    live: LiveSettings = await nursery.start(
        lambda task_status: serve_settings(
            cast(Store, fake), cluster, seed, seed_source=source, task_status=task_status
        )
    )
    return live


async def test_the_log_says_where_the_settings_came_from(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Seeded from the defaults (no file), from a named file, or loaded
    from the store: each start says which, never a file that is not there."""
    fake, cluster = SettingsStore(), Cluster()
    with caplog.at_level(logging.INFO, logger="llmgw.control.live"):
        async with trio.open_nursery() as nursery:
            await start_loop(nursery, fake, cluster, ServerSettings(), source=None)
            nursery.cancel_scope.cancel()
        assert (
            "settings seeded from the defaults, there being no settings file (version 1)"
            in caplog.text
        )
        assert "server.yaml" not in caplog.text
        assert fake.history[0].actor == "defaults"
        caplog.clear()
        async with trio.open_nursery() as nursery:
            await start_loop(nursery, fake, Cluster(), ServerSettings(), source=None)
            nursery.cancel_scope.cancel()
        assert caplog.messages == ["settings loaded from the store (version 1)"]
        caplog.clear()
        other = SettingsStore()
        async with trio.open_nursery() as nursery:
            await start_loop(nursery, other, Cluster(), SEED, source="/etc/llmgw/server.yaml")
            nursery.cancel_scope.cancel()
        assert "settings seeded from /etc/llmgw/server.yaml (version 1)" in caplog.text
        assert other.history[0].actor == "server.yaml"


async def test_the_first_start_seeds_the_store_from_server_yaml(autojump_clock: Any) -> None:
    fake, cluster = SettingsStore(), Cluster()
    async with trio.open_nursery() as nursery:
        live = await start_loop(nursery, fake, cluster)
        assert live.version == 1
        assert cluster.settings == SEED
        nursery.cancel_scope.cancel()
    [seeded] = fake.history
    assert seeded.actor == "server.yaml"
    assert settings_from_doc(seeded.document) == SEED


async def test_a_stored_document_wins_over_the_seed_and_is_never_overwritten(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake, cluster = SettingsStore(), Cluster()
    fake.write(stopped_doc(True))
    async with trio.open_nursery() as nursery:
        with caplog.at_level(logging.WARNING, logger="llmgw.control.live"):
            live = await start_loop(nursery, fake, cluster)
        [warning] = caplog.records
        assert "differ from server.yaml in on_demand.evict_after_idle, serving.stopped" in (
            warning.getMessage()
        )
        assert cluster.settings.serving.stopped
        assert cluster.settings.on_demand.evict_after_idle == 120.0  # not the seed's 45
        assert live.version == 1
        nursery.cancel_scope.cancel()
    assert len(fake.history) == 1


async def test_a_change_in_the_store_is_applied_within_a_poll_and_pokes_the_cluster(
    autojump_clock: Any,
) -> None:
    fake, cluster = SettingsStore(), Cluster()
    async with trio.open_nursery() as nursery:
        live = await start_loop(nursery, fake, cluster)
        waiter = cluster.changed
        written_at = trio.current_time()
        fake.write(stopped_doc(True))
        await waiter.wait()
        assert trio.current_time() - written_at <= POLL_S
        assert cluster.settings.serving.stopped
        assert live.version == 2
        nursery.cancel_scope.cancel()


async def test_an_unchanged_version_is_not_read_again(autojump_clock: Any) -> None:
    fake, cluster = SettingsStore(), Cluster()
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, fake, cluster)
        calls = fake.calls
        await trio.sleep(10 * POLL_S + 0.5)
        # one settings_version() per poll and nothing else
        assert fake.calls - calls == 10
        nursery.cancel_scope.cancel()


async def test_a_bad_stored_document_is_logged_once_and_the_last_good_one_kept(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake, cluster = SettingsStore(), Cluster()
    async with trio.open_nursery() as nursery:
        live = await start_loop(nursery, fake, cluster)
        with caplog.at_level(logging.ERROR, logger="llmgw.control.live"):
            fake.write({"serving": {"stopped": "yes"}})
            await trio.sleep(5 * POLL_S)
        assert cluster.settings == SEED
        assert live.version == 1
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "version 2" in errors[0].getMessage()
        assert "serving.stopped" in errors[0].getMessage()

        fake.write(stopped_doc(True))
        await trio.sleep(POLL_S + 0.1)
        assert cluster.settings.serving.stopped
        assert live.version == 3
        nursery.cancel_scope.cancel()


async def test_an_unreachable_store_at_start_serves_the_seed_and_catches_up(
    autojump_clock: Any,
) -> None:
    fake, cluster = SettingsStore(), Cluster()
    fake.failing = True
    async with trio.open_nursery() as nursery:
        live = await start_loop(nursery, fake, cluster)
        assert cluster.settings == SEED
        assert live.version == 0
        await trio.sleep(3 * POLL_S)
        fake.failing = False
        await trio.sleep(POLL_S + 0.1)
        assert live.version == 1
        assert fake.history[0].actor == "server.yaml"
        nursery.cancel_scope.cancel()


async def test_an_outage_later_keeps_the_settings_and_resumes(autojump_clock: Any) -> None:
    fake, cluster = SettingsStore(), Cluster()
    async with trio.open_nursery() as nursery:
        live = await start_loop(nursery, fake, cluster)
        fake.failing = True
        await trio.sleep(5 * POLL_S)
        assert cluster.settings == SEED
        fake.failing = False
        fake.write(stopped_doc(True))
        await trio.sleep(POLL_S + 0.1)
        assert cluster.settings.serving.stopped
        assert live.version == 2
        nursery.cancel_scope.cancel()


# --- LiveSettings.update ---------------------------------------------------------------


async def seeded(fake: SettingsStore, cluster: Cluster) -> LiveSettings:
    live = LiveSettings(cast(Store, fake), cluster)
    await live.seed(ServerSettings())
    await live.refresh()
    return live


async def test_an_update_writes_the_next_version_and_applies_it_here_at_once() -> None:
    fake, cluster = SettingsStore(), Cluster()
    live = await seeded(fake, cluster)
    waiter = cluster.changed
    version, changed = await live.update(
        lambda doc: with_key(doc, "serving.stopped", True), actor="admin (key_1)", note="stop"
    )
    assert (version, changed) == (2, True)
    assert waiter.is_set()
    assert cluster.settings.serving.stopped
    assert live.version == 2
    assert (fake.history[-1].actor, fake.history[-1].note) == ("admin (key_1)", "stop")


async def test_an_update_that_changes_nothing_writes_nothing() -> None:
    fake, cluster = SettingsStore(), Cluster()
    live = await seeded(fake, cluster)
    assert await live.update(
        lambda doc: with_key(doc, "on_demand.evict_after_idle", "2m"), actor="a"
    ) == (1, False)
    assert len(fake.history) == 1


async def test_an_update_reads_again_when_another_writer_got_in_first() -> None:
    fake, cluster = SettingsStore(), Cluster()
    live = await seeded(fake, cluster)
    cordoned = settings_to_doc(ServerSettings())
    cordoned["nodes"]["cordoned"] = ["n1"]
    fake.write(cordoned)  # live has not seen version 2

    version, _ = await live.update(lambda doc: with_key(doc, "serving.stopped", True), actor="a")
    assert version == 3
    assert cluster.settings.serving.stopped
    assert cluster.settings.nodes.cordoned == ("n1",)  # the other writer's change is kept


async def test_an_update_expecting_an_old_version_is_a_conflict() -> None:
    fake, cluster = SettingsStore(), Cluster()
    live = await seeded(fake, cluster)
    fake.write(stopped_doc(True))
    with pytest.raises(Conflict, match="version 2 is live"):
        await live.update(lambda doc: doc, actor="a", expected_version=1)
    assert len(fake.history) == 2


async def test_an_update_that_does_not_validate_raises_and_writes_nothing() -> None:
    fake, cluster = SettingsStore(), Cluster()
    live = await seeded(fake, cluster)
    with pytest.raises(SettingsError, match=r"on_demand\.evict_after_idle"):
        await live.update(
            lambda doc: with_key(doc, "on_demand.evict_after_idle", "soon"), actor="a"
        )
    assert len(fake.history) == 1
    assert cluster.settings == ServerSettings()


async def test_an_older_version_is_never_applied_over_a_newer_one() -> None:
    cluster = Cluster()
    live = LiveSettings(cast(Store, SettingsStore()), cluster)
    assert live.apply(3, stopped_doc(True))
    assert not live.apply(2, stopped_doc(False))
    assert cluster.settings.serving.stopped


# --- keys and documents -----------------------------------------------------------------


def test_the_document_round_trips_through_settings_from_doc() -> None:
    settings = attrs.evolve(SEED, serving=ServingSettings(stopped=True))
    assert settings_from_doc(settings_to_doc(settings)) == settings


@pytest.mark.parametrize(
    "key",
    [
        "serving.stopped",
        "on_demand",
        "router.admission.bands",
        "auth.pricing.gemma-3-270m",
        "auth.pricing.gemma-3-270m.prompt_per_1k",
        "nodes.cordoned",
    ],
)
def test_key_paths_that_name_settings_are_accepted(key: str) -> None:
    check_key_path(key)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("router.nope", "router.nope: no such setting; router has admission, cache"),
        ("nope", "nope: no such setting; the top level has auth"),
        ("serving.stopped.deeper", "serving.stopped is a single value"),
        ("router.admission.bands.0", "router.admission.bands is a list: set it whole"),
        ("auth.pricing.m.nope", "auth.pricing.m has cached_per_1k"),
        ("", "not a dotted key"),
        ("a..b", "not a dotted key"),
    ],
)
def test_key_paths_that_name_nothing_are_refused_with_what_is_there(key: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        check_key_path(key)
    assert says in str(caught.value)


def test_with_key_sets_one_key_making_blocks_and_leaves_the_original_alone() -> None:
    doc = settings_to_doc(ServerSettings())
    changed = with_key(doc, "auth.pricing.gemma", {"prompt_per_1k": 100})
    assert changed["auth"]["pricing"] == {"gemma": {"prompt_per_1k": 100}}
    assert doc["auth"]["pricing"] == {}
    assert settings_from_doc(changed).auth.pricing["gemma"].prompt_per_1k == 100
    bands = with_key(doc, "router.admission.bands", [{"name": "gold", "priority": 300}])
    assert [b.name for b in settings_from_doc(bands).router.admission.bands] == ["gold"]


def test_changed_keys_names_the_leaves_that_differ() -> None:
    before = settings_to_doc(ServerSettings())
    after = with_key(with_key(before, "serving.stopped", True), "auth.pricing.m", {"x": 1})
    assert changed_keys(before, after) == ["auth.pricing.m.x", "serving.stopped"]
    assert changed_keys(before, before) == []
    assert changed_keys({}, {"a": {"b": 1}}) == ["a.b"]


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"serving": {"paused": True}}, "serving.paused: no such setting; serving has stopped"),
        (
            {"router": {"admission": {"bands": [{"name": "a", "priority": 1, "x": 2}]}}},
            "router.admission.bands[0].x: no such setting",
        ),
        ({"auth": {"pricing": {"m": {"nope": 1}}}}, "auth.pricing.m.nope: no such setting"),
        ({"zzz": {}}, "zzz: no such setting; the top level has auth"),
    ],
)
def test_a_document_with_an_unknown_key_is_refused_naming_its_whole_path(
    doc: dict[str, Any], says: str
) -> None:
    with pytest.raises(SettingsError) as caught:
        check_doc_keys(doc)
    assert says in str(caught.value)


def test_a_document_of_known_keys_passes_the_key_check() -> None:
    check_doc_keys(settings_to_doc(ServerSettings()))
