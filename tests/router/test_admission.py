"""Admission bands under trio's MockClock (autojump: waits cost no real time)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from llmgw.router.admission import Admission, AdmissionTimeout, Ticket
from llmgw.settings import DEFAULT_BANDS, BandSettings, settings_from_doc

# --- bands ---------------------------------------------------------------------------


def _bands(value: Any) -> tuple[BandSettings, ...]:
    """The bands of a settings document whose ``router.admission.bands`` is ``value``."""
    return settings_from_doc({"router": {"admission": {"bands": value}}}).router.admission.bands


def test_default_bands() -> None:
    interactive, bulk = DEFAULT_BANDS
    assert (interactive.name, interactive.priority, interactive.saturation) == (
        "interactive",
        100,
        1.0,
    )
    assert interactive.queue_ttl == 30.0
    assert (bulk.name, bulk.priority, bulk.saturation, bulk.queue_ttl) == ("bulk", 10, 0.5, 300.0)
    assert settings_from_doc({}).router.admission.bands == DEFAULT_BANDS
    admission = Admission()
    assert admission.band("") is interactive
    assert admission.band("bulk") is bulk
    assert admission.band("vanished") is interactive


def test_bands_from_settings_read_durations_and_defaults() -> None:
    bands = _bands(
        [
            {"name": "gold", "priority": 300, "saturation": 1, "queue_ttl": "1m"},
            {"name": "bulk", "priority": 10, "saturation": 0.25, "queue_ttl": 5},
            {"name": "plain", "priority": 50},
        ]
    )
    assert bands == (
        BandSettings(name="gold", priority=300, saturation=1.0, queue_ttl=60.0),
        BandSettings(name="bulk", priority=10, saturation=0.25, queue_ttl=5.0),
        BandSettings(name="plain", priority=50, saturation=1.0, queue_ttl=30.0),
    )
    # No "interactive" band: "" goes to the highest priority.
    assert Admission(bands).band("").name == "gold"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gold", r"router\.admission\.bands\[0\]"),
        ({"name": "gold"}, r"router\.admission\.bands\[0\]"),
        ([], "at least one band"),
        (["gold"], r"bands\[0\]"),
        ([{"priority": 1}], r"bands\[0\]\.name"),
        ([{"name": "a", "priority": 1, "colour": "red"}], "Extra fields.*colour"),
        ([{"name": "a", "priority": "high"}], r"bands\[0\]\.priority"),
        ([{"name": "a", "priority": True}], r"bands\[0\]\.priority"),
        ([{"name": "a", "priority": 1, "saturation": 0}], "saturation' must be > 0"),
        ([{"name": "a", "priority": 1, "saturation": 1.5}], "saturation' must be <= 1"),
        ([{"name": "a", "priority": 1, "saturation": "half"}], r"bands\[0\]\.saturation"),
        (
            [{"name": "a", "priority": 1, "queue_ttl": "soon"}],
            r"'soon' is not a duration.*queue_ttl",
        ),
        # The settings take 0; admission does not.
        ([{"name": "a", "priority": 1, "queue_ttl": 0}], "queue_ttl must be a positive"),
        (
            [{"name": "a", "priority": 1}, {"name": "a", "priority": 2}],
            "share a name",
        ),
    ],
)
def test_bad_bands_are_refused_naming_them(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Admission(_bands(value))


def test_band_and_admission_validation() -> None:
    with pytest.raises(ValueError, match="saturation"):
        BandSettings(name="x", priority=1, saturation=0.0, queue_ttl=1.0)
    with pytest.raises(ValueError, match="queue_ttl"):
        Admission([BandSettings(name="x", priority=1, saturation=1.0, queue_ttl=0.0)])
    with pytest.raises(ValueError, match="at least one band"):
        Admission([])
    with pytest.raises(ValueError, match="share a name"):
        Admission([DEFAULT_BANDS[0], DEFAULT_BANDS[0]])
    with pytest.raises(ValueError, match="negative"):
        Admission().set_capacity("m", -1)


# --- admission ---------------------------------------------------------------------------


class Recorder:
    """Runs requests in the background and records what happened to them."""

    def __init__(self, admission: Admission, nursery: trio.Nursery) -> None:
        self.admission = admission
        self.nursery = nursery
        self.admitted: list[str] = []
        self.timed_out: list[str] = []
        self.tickets: dict[str, Ticket] = {}

    async def start(self, name: str, band: str, capacity: int, model: str = "m") -> None:
        """Start a request and return once it is admitted or waiting (so
        requests arrive in the order started)."""

        async def run() -> None:
            try:
                ticket = await self.admission.admit(model, band, capacity)
            except AdmissionTimeout:
                self.timed_out.append(name)
                return
            self.admitted.append(name)
            self.tickets[name] = ticket

        self.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()


async def test_bulk_beyond_half_the_slots_queues_and_interactive_goes_ahead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission()
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        for i in range(4):
            await rec.start(f"bulk{i}", "bulk", 4)
            await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["bulk0", "bulk1"]
        assert admission.in_use("m") == 2
        assert admission.waiting("m") == 2
        await rec.start("chat0", "", 4)
        await rec.start("chat1", "interactive", 4)
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[2:] == ["chat0", "chat1"]
        assert admission.in_use("m") == 4
        await rec.start("chat2", "", 4)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting("m") == 3
        # A slot frees: the interactive waiter goes before the older bulk ones.
        rec.tickets["bulk0"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[-1] == "chat2"
        # Bulk waits until the model is below half its slots again.
        rec.tickets["chat0"].release()
        rec.tickets["chat1"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_use("m") == 2
        assert admission.waiting("m") == 2
        rec.tickets["chat2"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[-1] == "bulk2"  # FIFO within the band
        assert admission.waiting("m") == 1
        for ticket in list(rec.tickets.values()):
            ticket.release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[-1] == "bulk3"
        rec.tickets["bulk3"].release()
    assert admission.in_use("m") == 0
    assert admission.waiting("m") == 0
    assert not rec.timed_out


async def test_waiting_past_the_bands_queue_ttl_raises_admission_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission()
    held = await admission.admit("m", "", 1)
    start = trio.current_time()
    with pytest.raises(AdmissionTimeout) as caught:
        await admission.admit("m", "", 1)
    assert trio.current_time() - start == pytest.approx(30.0)
    assert caught.value.retry_after_s == 30.0
    assert caught.value.band == "interactive"
    with pytest.raises(AdmissionTimeout) as caught:
        await admission.admit("m", "bulk", 1)
    assert caught.value.retry_after_s == 60.0  # bounded
    assert admission.waiting("m") == 0
    held.release()
    held.release()  # twice is harmless
    assert admission.in_use("m") == 0


async def test_a_cancelled_waiter_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission()
    held = await admission.admit("m", "", 1)
    with trio.move_on_after(5):
        await admission.admit("m", "", 1)
    assert admission.waiting("m") == 0
    assert admission.in_use("m") == 1
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        await rec.start("late", "", 1)
        await trio.testing.wait_all_tasks_blocked()
        held.release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["late"]  # the cancelled one did not take the slot
        rec.tickets["late"].release()
    assert admission.in_use("m") == 0


async def test_slot_releases_on_every_path(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    async with admission.slot("m", "", 2) as ticket:
        assert admission.in_use("m") == 1
        assert not ticket.released
    assert admission.in_use("m") == 0
    with pytest.raises(RuntimeError):
        async with admission.slot("m", "", 2):
            raise RuntimeError("boom")
    assert admission.in_use("m") == 0
    with trio.move_on_after(1):
        async with admission.slot("m", "", 2):
            await trio.sleep_forever()
    assert admission.in_use("m") == 0


async def test_capacity_zero_admits_at_once_and_frees_the_waiters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission()
    tickets = [await admission.admit("outside", "bulk", 0) for _ in range(100)]
    assert admission.in_use("outside") == 100
    for ticket in tickets:
        ticket.release()
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        await rec.start("a", "", 1)
        await rec.start("b", "", 1)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting("m") == 1
        admission.set_capacity("m", 0)  # unbounded now: everyone goes
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["a", "b"]
        for ticket in rec.tickets.values():
            ticket.release()


async def test_the_latest_capacity_counts(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        await rec.start("a", "", 1)
        await rec.start("b", "", 1)
        await rec.start("c", "", 1)
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["a"]
        await rec.start("d", "", 3)  # a replica came up: room for two more
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(rec.admitted) == ["a", "b", "c"]  # b and c wake in any order
        assert admission.waiting("m") == 1
        admission.set_capacity("m", 1)  # and went again: nothing new goes in
        rec.tickets["a"].release()
        rec.tickets["b"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting("m") == 1
        rec.tickets["c"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[-1] == "d"
        rec.tickets["d"].release()


async def test_changing_bands_admits_whom_the_new_thresholds_allow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission()
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        for name in ("b0", "b1", "b2"):
            await rec.start(name, "bulk", 4)
            await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["b0", "b1"]
        admission.set_bands(
            [
                DEFAULT_BANDS[0],
                BandSettings(name="bulk", priority=10, saturation=0.75, queue_ttl=300.0),
            ]
        )
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["b0", "b1", "b2"]
        for ticket in rec.tickets.values():
            ticket.release()


async def test_a_higher_priority_band_held_by_its_own_threshold_does_not_block_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bands = [
        BandSettings(name="gold", priority=300, saturation=0.5, queue_ttl=30.0),
        BandSettings(name="interactive", priority=100, saturation=1.0, queue_ttl=30.0),
    ]
    admission = Admission(bands)
    async with trio.open_nursery() as nursery:
        rec = Recorder(admission, nursery)
        for name in ("g0", "g1", "g2"):
            await rec.start(name, "gold", 4)
            await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["g0", "g1"]
        await rec.start("i0", "interactive", 4)
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted == ["g0", "g1", "i0"]
        # When the model drops below half, gold goes first.
        rec.tickets["g0"].release()
        rec.tickets["g1"].release()
        await trio.testing.wait_all_tasks_blocked()
        assert rec.admitted[-1] == "g2"
        for ticket in rec.tickets.values():
            ticket.release()


async def test_models_are_independent(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    a = await admission.admit("a", "", 1)
    b = await admission.admit("b", "", 1)
    assert (admission.in_use("a"), admission.in_use("b"), admission.in_use("c")) == (1, 1, 0)
    assert admission.waiting("c") == 0
    a.release()
    b.release()
