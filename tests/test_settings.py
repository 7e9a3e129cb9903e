"""server.yaml: defaults, durations, prices, and unknown keys refused by path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.settings import (
    Price,
    SettingsError,
    check_doc_keys,
    load_settings,
    parse_duration_s,
    settings_from_doc,
)


def test_without_a_file_the_spec_defaults_apply() -> None:
    auth = load_settings(None).auth
    assert (auth.default_rpm, auth.default_tpm) == (60, 200_000)
    assert auth.max_key_ttl is None
    assert auth.default_price == Price()


def test_durations_prices_and_limits_are_read_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(
        "auth:\n  default_rpm: 10\n  max_key_ttl: 90d\n  flush_interval: 500ms\n".replace(
            "500ms", "0.5"
        )
        + "  pricing:\n"
        "    m: {prompt_per_1k: 2500, cached_per_1k: 250, completion_per_1k: 10000}\n"
    )
    auth = load_settings(path).auth
    assert auth.default_rpm == 10
    assert auth.max_key_ttl == 90 * 86400
    assert auth.flush_interval == 0.5
    assert auth.pricing["m"] == Price(
        prompt_per_1k=2500, cached_per_1k=250, completion_per_1k=10000
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("auth:\n  default_rmp: 10\n", "default_rmp"),
        ("auth:\n  pricing:\n    m: {prompt_per_1k: 1.5}\n", "prompt_per_1k"),
        ("nonsense: 1\n", "nonsense"),
        ("auth:\n  max_key_ttl: forever\n", "max_key_ttl"),
    ],
)
def test_a_bad_file_is_refused_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=needle):
        load_settings(path)


def test_duration_forms() -> None:
    assert parse_duration_s("45s") == 45
    assert parse_duration_s("30m") == 1800
    assert parse_duration_s("12h") == 43200
    assert parse_duration_s(7) == 7
    with pytest.raises(ValueError, match="duration"):
        parse_duration_s("soon")


def test_live_blocks_have_defaults_and_bands_parse_from_a_document() -> None:
    settings = settings_from_doc(
        {
            "serving": {"stopped": True},
            "router": {
                "admission": {
                    "bands": [
                        {"name": "gold", "priority": 300, "saturation": 1, "queue_ttl": "1m"},
                        {"name": "bulk", "priority": 1, "saturation": 0.25},
                    ]
                }
            },
            "on_demand": {"evict_after_idle": "2s"},
        }
    )
    assert settings.serving.stopped is True
    gold, bulk = settings.router.admission.bands
    assert (gold.name, gold.priority, gold.queue_ttl) == ("gold", 300, 60.0)
    assert (bulk.saturation, bulk.queue_ttl) == (0.25, 30.0)
    assert settings.on_demand.evict_after_idle == 2.0
    assert settings.on_demand.min_lifetime == 300.0
    assert settings.nodes.drain_grace == 300.0


def test_a_band_that_may_fill_more_than_every_slot_is_refused() -> None:
    with pytest.raises(SettingsError, match="saturation"):
        settings_from_doc(
            {"router": {"admission": {"bands": [{"name": "x", "priority": 1, "saturation": 2}]}}}
        )


def test_no_bands_or_two_of_one_name_are_refused() -> None:
    with pytest.raises(SettingsError, match="at least one band"):
        settings_from_doc({"router": {"admission": {"bands": []}}})
    with pytest.raises(SettingsError, match="share a name"):
        settings_from_doc(
            {
                "router": {
                    "admission": {
                        "bands": [{"name": "a", "priority": 1}, {"name": "a", "priority": 2}],
                        "default_band": "a",
                    }
                }
            }
        )


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"router": {"timeouts": {"connect": 0}}}, "connect must be longer than 0 s"),
        ({"router": {"timeouts": {"first_byte": "0s"}}}, "first_byte must be longer than 0 s"),
        ({"router": {"scoring": "nonsense"}}, "'nonsense' is not chat, batch or long-context"),
        ({"on_demand": {"evict_after_idle": float("nan")}}, "not a finite duration"),
    ],
)
def test_settings_that_would_break_routing_are_refused(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(says)):
        settings_from_doc(doc)


def test_guard_defaults_run_baseline_and_the_built_in_policies_exist() -> None:
    from llmgw.settings import GUARD_BUILTIN_POLICIES, ServerSettings

    guard = ServerSettings().guard
    assert guard.enabled
    assert guard.default == ("baseline",)
    assert set(GUARD_BUILTIN_POLICIES) == {"baseline", "observe"}
    baseline = guard.policy("baseline")
    assert baseline.input.secrets == "block"
    assert baseline.output.secrets == "block"
    assert baseline.input.pii == {"card": "mask"}
    assert baseline.input.injection == "flag"
    observe = guard.policy("observe")
    assert "block" not in {observe.input.secrets, *observe.input.pii.values()}


def test_guard_policies_read_from_a_document_and_back() -> None:
    from llmgw.settings import settings_to_doc

    doc = {
        "guard": {
            "default": ["baseline"],
            "policies": {
                "strict": {
                    "input": {
                        "pii": {"email": "redact", "phone": "block"},
                        "deny": ["(?i)project zeus"],
                        "max_chars": 1000,
                        "restore": True,
                    },
                    "output": {"secrets": "redact"},
                    "no_store": True,
                }
            },
            "attach": {"project:p1": ["strict"], "org:o1": ["observe"]},
        }
    }
    settings = settings_from_doc(doc)
    strict = settings.guard.policy("strict")
    assert strict.input.pii == {"email": "redact", "phone": "block"}
    assert strict.input.restore
    assert settings.guard.attach["project:p1"] == ("strict",)
    assert settings_from_doc(settings_to_doc(settings)) == settings


@pytest.mark.parametrize(
    ("guard", "says"),
    [
        ({"policies": {"p": {"input": {"pii": {"emial": "redact"}}}}}, "pii.emial: no such kind"),
        (
            {"policies": {"p": {"input": {"pii": {"email": "mask"}}}}},
            "only card numbers are masked",
        ),
        ({"policies": {"p": {"input": {"secrets": "burn"}}}}, "'burn' is not one of"),
        ({"policies": {"p": {"input": {"colour": 1}}}}, "colour"),
        ({"policies": {"p": {"output": {"deny": ["("]}}}}, "deny[0]"),
        ({"policies": {"p": {"output": {"deny": ["a", "(?<=x)y"]}}}}, "deny[1]"),
        ({"default": ["nope"]}, "default: no policy 'nope'"),
        ({"attach": {"project:p1": ["nope"]}}, "attach.project:p1: no policy 'nope'"),
        ({"attach": {"building:1": ["baseline"]}}, "not org:ID, team:ID"),
        ({"policies": {"p": {"input": {"max_chars": -1}}}}, "max_chars"),
    ],
)
def test_a_bad_guard_setting_is_refused_with_its_path(guard: dict[str, Any], says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from_doc({"guard": guard})
    assert says in str(caught.value)
    assert "guard" in str(caught.value)


def test_a_settings_file_not_in_utf8_is_a_settings_error(tmp_path: Path) -> None:
    # Found by fuzz/targets/settings.py: a UnicodeDecodeError escaped.
    path = tmp_path / "server.yaml"
    path.write_bytes(b"auth:\n  pricin\xb9: {}\n")
    with pytest.raises(SettingsError, match="UTF-8"):
        load_settings(path)


def test_a_key_that_is_not_text_is_a_settings_error(tmp_path: Path) -> None:
    # Found by fuzz/targets/fuzz_settings.py: cattrs' message for the
    # unknown keys sorted a float among strings and raised TypeError.
    path = tmp_path / "server.yaml"
    path.write_text("auth:\n  pricing:\n    gemma: {prompt_per_1k: 0.001, 55.002: 1}\n")
    with pytest.raises(SettingsError, match=r"55\.002"):
        load_settings(path)
    with pytest.raises(SettingsError, match="7"):
        settings_from_doc({"auth": {7: 1, "cache_ttl": "1s"}})


def test_the_lease_ttl_defaults_to_10_s_and_is_read_as_a_duration_of_at_least_2_s() -> None:
    assert settings_from_doc({}).ha.lease_ttl_s == 10.0
    assert settings_from_doc({"ha": {"lease_ttl_s": "3s"}}).ha.lease_ttl_s == 3.0
    with pytest.raises(SettingsError, match=r"lease_ttl_s must be at least 2 s.*\.ha"):
        settings_from_doc({"ha": {"lease_ttl_s": 1}})
    with pytest.raises(SettingsError, match=r"ttl.*\.ha"):
        settings_from_doc({"ha": {"ttl": 5}})


def test_mirrors_and_weights_settings() -> None:
    from llmgw.settings import settings_to_doc

    settings = settings_from_doc(
        {"mirrors": ["http://m:8090"], "weights": {"hf_endpoint": "https://hub", "token_file": "t"}}
    )
    assert settings.mirrors == ("http://m:8090",)
    assert settings.weights.hf_endpoint == "https://hub"
    assert settings_from_doc(settings_to_doc(settings)) == settings
    for doc, said in (
        ({"mirrors": "http://m"}, "mirrors: must be a list"),
        ({"mirrors": ["ftp://m"]}, "mirrors[0]: 'ftp://m' is not an http"),
        ({"weights": {"hf_endpoint": "hub"}}, "hf_endpoint: 'hub' is not an http"),
        ({"weights": {"token": "x"}}, "token"),
        ({"mirrors": ["http://[::1"]}, "mirrors[0]: 'http://[::1' is not a valid URL"),
        ({"mirrors": ["http://m:99999"]}, "mirrors[0]: 'http://m:99999' is not a valid URL"),
        ({"mirrors": ["http://:8090"]}, "mirrors[0]: 'http://:8090' is not a valid URL"),
        ({"mirrors": ["http://m:1", "http://m:1/"]}, "mirrors[1]: 'http://m:1/' is listed twice"),
        ({"weights": {"hf_endpoint": "https://[::1"}}, "hf_endpoint: 'https://[::1' is not a"),
    ):
        with pytest.raises(SettingsError, match=re.escape(said)):
            settings_from_doc(doc)


def test_top_level_errors_end_without_a_dangling_at() -> None:
    for doc in ({"mirrors": ["ftp://x:1"]}, {"mirrors": [5]}):
        with pytest.raises(SettingsError) as caught:
            settings_from_doc(doc)
        assert not str(caught.value).rstrip().endswith(" at"), str(caught.value)
        assert str(caught.value).startswith("mirrors[0]: ")
    with pytest.raises(SettingsError, match=r"lease_ttl_s must be at least 2 s at \.ha$"):
        settings_from_doc({"ha": {"lease_ttl_s": 1}})


def test_an_empty_text_setting_is_the_empty_default() -> None:
    # ``ctl config set portal.external_url ''`` sends YAML "" -> None.
    assert settings_from_doc({"portal": {"external_url": None}}).portal.external_url == ""
    assert settings_from_doc({"weights": {"hf_endpoint": None}}).weights.hf_endpoint == ""


def test_a_list_of_texts_given_one_text_is_refused_not_split_into_letters() -> None:
    """``categories: Violent`` would otherwise become V, i, o, … and refuse
    nothing the judge calls violent; ``deny: zeus`` would refuse every "e"."""
    for where, doc, said in (
        (
            "judge.categories",
            {"judge": {"model": "m", "categories": "Violent"}},
            "expected a list of texts, like ['Violent']",
        ),
        ("input.deny", {"input": {"deny": "zeus"}}, "expected a list of texts, like ['zeus']"),
        ("judge.model", {"judge": {"model": ["a"]}}, "expected text, got ['a']"),
        ("judge", {"judge": "guard1"}, "expected a block of settings (a mapping)"),
        ("stream", {"stream": None}, "expected a block of settings (a mapping)"),
    ):
        with pytest.raises(SettingsError) as caught:
            settings_from_doc({"guard": {"policies": {"p": doc}}})
        assert said in str(caught.value), where
        assert f"at .guard.policies['p'].{where}" in str(caught.value), where
    policy = settings_from_doc(
        {"guard": {"policies": {"p": {"judge": {"model": "m", "categories": ["Violent"]}}}}}
    ).guard.policies["p"]
    assert policy.judge is not None
    assert policy.judge.categories == ("Violent",)


def test_an_unquoted_yaml_on_key_is_the_judges_on() -> None:
    doc = yaml.safe_load("guard: {policies: {p: {judge: {model: m, on: both}}}}")
    judge = settings_from_doc(doc).guard.policies["p"].judge
    assert judge is not None
    assert judge.on == "both"
    check_doc_keys(doc)  # the admin API's key check reads it the same way
    # Sent as JSON (ctl config set reads the value as YAML, then sends JSON).
    from_json = {"guard": {"policies": {"p": {"judge": {"model": "m", "true": "output"}}}}}
    check_doc_keys(from_json)
    sent = settings_from_doc(from_json).guard.policies["p"].judge
    assert sent is not None
    assert sent.on == "output"
