"""Catalog entries: the written form (parse_model) and the rules (validate_model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from llmgw.control.catalog import CatalogError, load_model_file, parse_model, validate_model
from llmgw.control.planning import ModelFacts
from llmgw.store._catalog_json import model_to_doc
from llmgw.store.records import External, ExternalKey, ModelRecord, Profile


def _facts(**fields: Any) -> ModelFacts:
    base: dict[str, Any] = {
        "path": "/models/m",
        "format": "gguf",
        "architecture": "llama",
        "layers": 32,
        "kv_heads": 8,
        "heads": 32,
        "head_dim": 128,
        "context_length": 32768,
        "weights_bytes": 4 * 10**9,
        "active_weights_bytes": 4 * 10**9,
        "quantization": "Q4_K_M",
    }
    base.update(fields)
    return ModelFacts(**base)


_MODEL_ONLY = ("context_length", "max_output")


def _cpu(name: str = "m", **profile: Any) -> ModelRecord:
    """A llama.cpp CPU model; ``context_length``/``max_output`` go to the model."""
    model = {key: profile.pop(key) for key in _MODEL_ONLY if key in profile}
    fields: dict[str, Any] = {"engine": "llamacpp", "min_memory_gb": 8.0}
    fields.update(profile)
    return ModelRecord(name=name, source="/models/m.gguf", profiles=(Profile(**fields),), **model)


def _gpu(tp: int, gpus: int | None = None, gpu_class: str = "h100-80g") -> ModelRecord:
    profile = Profile(engine="llamacpp", gpu_class=gpu_class, gpus=gpus or tp, tp=tp)
    return ModelRecord(name="g", source="/models/g.gguf", profiles=(profile,))


def _problems(model: ModelRecord, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(CatalogError) as caught:
        validate_model(model, *args, **kwargs)
    assert str(caught.value) == "; ".join(caught.value.problems)
    return str(caught.value)


# --- parse_model -------------------------------------------------------------------


def test_top_level_profile_fields_make_one_default_profile() -> None:
    model = parse_model(
        {
            "name": "qwen2.5-7b",
            "source": "/models/qwen.gguf",
            "engine": "llamacpp",
            "context": 16384,
            "slots": 4,
            "cpu_cores": 8,
            "min_memory_gb": 8,
            "args": "--flash-attn on --temp 0.7",
            "env": {"OMP_NUM_THREADS": 8},
            "scaling": {"min": 1, "max": 2},
        }
    )
    (profile,) = model.profiles
    assert profile == Profile(
        name="default",
        engine="llamacpp",
        context_tokens=16384,
        slots=4,
        cpu_cores=8,
        min_memory_gb=8.0,
        args=("--flash-attn", "on", "--temp", "0.7"),
        env={"OMP_NUM_THREADS": "8"},
        replicas=2,
    )
    assert model.name == "qwen2.5-7b"
    assert model.source == "/models/qwen.gguf"


def test_store_form_round_trips() -> None:
    model = ModelRecord(
        name="m",
        source="/models/m.gguf",
        aliases=("m-latest",),
        profiles=(
            Profile(name="gpu", engine="llamacpp", gpu_class="h100-80g", gpus=2, replicas=7),
            Profile(name="cpu", engine="llamacpp", min_memory_gb=6.5, cpu_cores=4, replicas=4),
        ),
        context_length=32768,
        max_output=4096,
        fallbacks=("small",),
    )
    assert parse_model(model_to_doc(model)) == model


def test_profile_conveniences() -> None:
    model = parse_model(
        {
            "name": "m",
            "profiles": [
                {
                    "name": "a",
                    "engine": "sim",
                    "context": 2048,
                    "gpus_per_node": 2,
                    "gpu_class": "l4-24g",
                    "startup_timeout": "20m",
                    "args": ["--threads", 4],
                }
            ],
        }
    )
    profile = model.profiles[0]
    assert profile.context_tokens == 2048
    assert profile.gpus == 2
    assert profile.startup_timeout_s == 1200.0
    assert profile.args == ("--threads", "4")


def test_external_block() -> None:
    one = parse_model(
        {
            "name": "outside",
            "source": "external",
            "external": {"url": "https://api.example.com", "model": "gpt-x", "api_key_file": "/k"},
        }
    )
    assert one.source == ""
    assert one.external == External(
        url="https://api.example.com", model="gpt-x", api_key_files=(ExternalKey(file="/k"),)
    )
    several = parse_model(
        {
            "name": "outside",
            "external": {
                "url": "http://peer:8080",
                "model": "m",
                "api_key_files": [{"file": "/a", "weight": 3}, "/b"],
            },
        }
    )
    assert several.external is not None
    assert several.external.api_key_files == (
        ExternalKey(file="/a", weight=3),
        ExternalKey(file="/b"),
    )
    validate_model(one)
    validate_model(several)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"name": "m", "engine": "sim", "enigne": "x"}, "enigne: unknown key"),
        (
            {"name": "m", "profiles": [{"engine": "sim"}, {"engine": "sim", "slot": 2}]},
            "profiles[1].slot: unknown key",
        ),
        (
            {"name": "m", "external": {"url": "http://x", "model": "y", "key": "z"}},
            "external.key: unknown key",
        ),
        ({"name": "m", "engine": "sim", "scaling": {"mid": 1, "max": 1}}, "scaling.mid"),
        ({"engine": "sim"}, "name: missing"),
        (
            {"name": "m", "allow_pickle": "no", "engine": "sim"},
            "allow_pickle: expected true or false",
        ),
        ({"name": "m", "engine": "sim", "slots": "4"}, "profile.slots: expected an integer"),
        ({"name": "m", "engine": "sim", "slots": 4.5}, "profile.slots: expected an integer"),
        ({"name": "m", "aliases": "x", "engine": "sim"}, "aliases: expected a list of strings"),
        ({"name": "m", "profiles": [{"slots": 2}]}, "profiles[0].engine: missing"),
        (
            {"name": "m", "engine": "sim", "profiles": [{"engine": "sim"}]},
            "profile fields at the top level",
        ),
        (
            {"name": "m", "profiles": [{"engine": "sim", "context": 1, "context_tokens": 2}]},
            "given twice",
        ),
        ({"name": "m", "engine": "sim", "replicas": 3, "scaling": {"max": 2}}, "disagrees"),
        (
            {
                "name": "m",
                "profiles": [{"engine": "sim", "replicas": 1}, {"engine": "sim", "name": "b"}],
                "scaling": {"min": 0, "max": 5},
            },
            "add up to 2",
        ),
        ({"name": "m", "engine": "sim", "scaling": {"min": 3, "max": 2}}, "0 <= min <= max"),
        ({"name": "m", "source": "external"}, "source: external needs the block"),
        (
            {
                "name": "m",
                "external": {"url": "http://x", "model": "y", "api_key_file": "a"}
                | {"api_key_files": ["b"]},
            },
            "not both",
        ),
        ({"name": "m", "engine": "sim", "env": {"A": [1]}}, "env.A: expected a string"),
        ("name: m", "model: expected a mapping"),
    ],
)
def test_parse_refusals(doc: Any, message: str) -> None:
    with pytest.raises(CatalogError) as caught:
        parse_model(doc)
    assert message in str(caught.value)


def test_scaling_shapes() -> None:
    two = parse_model(
        {
            "name": "m",
            "profiles": [
                {"name": "a", "engine": "sim", "replicas": 7},
                {"name": "b", "engine": "sim", "replicas": 4},
            ],
            "scaling": {"min": 11, "max": 11},
        }
    )
    assert two.replicas == 11
    stopped = parse_model({"name": "m", "engine": "sim", "scaling": {"min": 0, "max": 0}})
    assert stopped.replicas == 0


def test_load_model_file(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nengine: sim\ncontext: 4096\nslots: 2\n")
    assert load_model_file(path).profiles[0].slots == 2
    path.write_text("name: [unclosed\n")
    with pytest.raises(CatalogError, match="not YAML"):
        load_model_file(path)
    with pytest.raises(CatalogError, match="cannot read"):
        load_model_file(tmp_path / "missing.yaml")


# --- validate_model ----------------------------------------------------------------


def test_a_good_entry_passes() -> None:
    validate_model(_cpu(context_length=0), facts=_facts())
    validate_model(ModelRecord.simple("s", "sim"), new=False)


@pytest.mark.parametrize(
    "name",
    ["", "-flag", "has space", "a" * 129, "naïve", "x?y", ".hidden"],
)
def test_bad_names(name: str) -> None:
    assert "name" in _problems(attrs.evolve(_cpu(), name=name))


def test_good_names() -> None:
    for name in ("meta-llama/Llama-3.3-70B", "qwen2.5:7b", "a_b.c", "a" * 128):
        validate_model(attrs.evolve(_cpu(), name=name))


def test_names_and_aliases_unique_across_the_catalog() -> None:
    other = attrs.evolve(_cpu("other"), aliases=("shared",))
    assert "already the name of other" in _problems(_cpu("other"), [other], new=True)
    clash = attrs.evolve(_cpu("m"), aliases=("shared",))
    assert "already an alias of other" in _problems(clash, [other])
    assert "already the name of other" in _problems(
        attrs.evolve(_cpu("m"), aliases=("other",)), [other]
    )
    assert "repeats" in _problems(attrs.evolve(_cpu("m"), aliases=("m",)))
    assert "repeats" in _problems(attrs.evolve(_cpu("m"), aliases=("x", "x")))
    # updating an entry: its own old self does not count
    old = attrs.evolve(_cpu("m"), aliases=("m-old",))
    validate_model(attrs.evolve(old, aliases=("m-old", "m-new")), [old, other])


def test_profiles_needed_unless_external() -> None:
    assert "at least one is needed" in _problems(ModelRecord(name="m"))


def test_external_rules() -> None:
    ok = External(url="https://api.example.com", model="x", api_key_files=(ExternalKey(file="/k"),))
    validate_model(ModelRecord(name="m", external=ok))
    text = _problems(
        ModelRecord(
            name="m",
            external=External(url="ftp://x", model="", api_key_files=()),
            profiles=(Profile(engine="sim"),),
        ),
        new=False,
    )
    assert "must be an http(s) URL" in text
    assert "external.model is empty" in text
    assert "at least one key file" in text
    assert "has no profiles" in text


def test_engine_args_env_vetted() -> None:
    assert "unknown engine 'nope'" in _problems(_cpu(engine="nope"))
    assert "--hf-repo is refused: it downloads a model" in _problems(_cpu(args=("--hf-repo", "x")))
    assert "--trust-remote-code" in _problems(_cpu(engine="sim", args=("--trust-remote-code",)))
    assert "HF_TOKEN is refused: it is a credential" in _problems(_cpu(env={"HF_TOKEN": "x"}))
    assert "LD_PRELOAD" in _problems(_cpu(env={"LD_PRELOAD": "x"}))
    validate_model(_cpu(args=("--chat-template", "chatml"), env={"OMP_NUM_THREADS": "4"}))


def test_counts() -> None:
    text = _problems(_cpu(slots=0, context_tokens=0, replicas=-1, cpu_cores=-2))
    for field in ("slots", "context_tokens", "replicas", "cpu_cores"):
        assert f"profiles[0].{field} must be at least" in text
    assert "min_memory_gb must be 0 or more" in _problems(_cpu(min_memory_gb=-1.0), new=False)
    validate_model(_cpu(replicas=0))


def test_tp_must_fit_kv_heads() -> None:
    facts = _facts(kv_heads=8)
    for tp in (1, 2, 4, 8, 16):
        validate_model(_gpu(tp), facts=facts)
    for tp in (3, 12):
        assert "KV heads" in _problems(_gpu(tp), facts=facts)
    validate_model(_gpu(3))  # no facts: nothing to check against
    assert "tensor-parallel groups" in _problems(_gpu(2, gpus=3))


def test_mig_needs_one_card() -> None:
    mig = "a100-80g-mig-3g.40gb"
    validate_model(_gpu(1, gpu_class=mig))
    assert "MIG class" in _problems(_gpu(1, gpus=2, gpu_class=mig))
    assert "MIG class" in _problems(_gpu(2, gpu_class=mig))


def test_gpu_fields_need_a_class() -> None:
    assert "gpu_class is empty" in _problems(_cpu(gpus=1))
    assert "tp is 2 on CPU" in _problems(_cpu(tp=2))
    no_cards = ModelRecord(name="g", profiles=(Profile(engine="llamacpp", gpu_class="l4-24g"),))
    assert "gpus must be at least 1" in _problems(no_cards)


def test_new_cpu_model_states_memory() -> None:
    bare = _cpu(min_memory_gb=0.0)
    text = _problems(bare)
    assert "must state its memory: min_memory_gb (--min-memory-gb on the command line)" in text
    with_figures = _problems(bare, facts=_facts(), new=True)
    assert "about 5.2 GB at 4,096 tokens" in with_figures
    validate_model(bare, new=False)
    validate_model(bare, [bare])  # an update of a stored entry
    validate_model(_gpu(1))  # cards: placement checks the card memory


def test_context_beyond_training_refused_with_figures() -> None:
    long = _cpu(context_tokens=65536, slots=1)
    text = _problems(attrs.evolve(long, context_length=32768))
    assert "context per slot 65,536 tokens (65,536 / 1 slots)" in text
    assert "trained 32,768" in text
    assert "trained 32,768" in _problems(long, facts=_facts(context_length=32768))
    validate_model(_cpu(context_tokens=65536, slots=2, context_length=32768))
    validate_model(long)  # trained length unknown


def test_max_output_within_context() -> None:
    assert "beyond the trained context" in _problems(_cpu(context_length=8192, max_output=8193))
    validate_model(_cpu(context_length=8192, max_output=8192))
    assert "largest context per slot 1,024" in _problems(
        _cpu(context_tokens=4096, slots=4, max_output=2048)
    )


@pytest.mark.parametrize(
    "source",
    [
        "/models/pytorch_model.bin",
        "/m/x.PT",
        "/srv/org/repo/model.pth",
        "https://mirror:8081/m/rev/weights.ckpt?download=1",
        "/m/x.pkl",
        "/m/x.pickle",
    ],
)
def test_pickle_needs_allow_pickle(source: str) -> None:
    model = attrs.evolve(_cpu(), source=source)
    assert "allow_pickle" in _problems(model)
    validate_model(attrs.evolve(model, allow_pickle=True))


def test_misc_rules() -> None:
    assert "routing 'fast'" in _problems(attrs.evolve(_cpu(), routing="fast"))
    assert "names the model itself" in _problems(attrs.evolve(_cpu(), fallbacks=("m",)))
    assert "sha256" in _problems(attrs.evolve(_cpu(), sha256="abc"))
    twice = ModelRecord(
        name="m",
        profiles=(
            Profile(engine="sim", min_memory_gb=1),
            Profile(engine="sim", min_memory_gb=1),
        ),
    )
    assert "used by another profile" in _problems(twice)


def test_an_unpinned_hf_source_is_refused_pointing_at_model_serve() -> None:
    # ``ctl model add zz2 --source hf:llmgw/gemma-3-270m-gguf`` was accepted,
    # and its replica failed later with "no model file hf:…".
    for source in ("hf:llmgw/gemma-3-270m-gguf", f"hf:org/repo@{'a' * 40}/m.gguf"):
        said = _problems(attrs.evolve(_cpu(), source=source))
        assert "use llmgw ctl model serve hf:ORG/REPO[@REV]" in said, said


def test_every_problem_listed_at_once() -> None:
    with pytest.raises(CatalogError) as caught:
        validate_model(ModelRecord(name="bad name", routing="x", source="/a.bin"))
    assert len(caught.value.problems) == 4
    assert isinstance(caught.value, ValueError)


def test_a_catalog_file_not_in_utf8_is_a_catalog_error(tmp_path: Path) -> None:
    # Found by fuzz/targets/catalog.py: a UnicodeDecodeError escaped.
    path = tmp_path / "model.yaml"
    path.write_bytes(b"name: gemma\nsource: \xe5\n")
    with pytest.raises(CatalogError, match="UTF-8"):
        load_model_file(path)


@pytest.mark.parametrize(
    ("source", "pickle"),
    [("hf://o@@@@r gpt-outsexternaher]", False), ("hf://o@[x/model.bin", True)],
)
def test_a_source_urllib_cannot_read_is_judged_by_its_text_not_a_crash(
    tmp_path: Path, source: str, pickle: bool
) -> None:
    """Found by fuzzing (``fuzz/corpus/catalog``): urlsplit's "Invalid IPv6
    URL" escaped validate_model as a ValueError."""
    path = tmp_path / "model.yaml"
    path.write_text(f"name: gemma\nsource: {source}\nrouting: batch\n")
    model = load_model_file(path)
    if pickle:
        with pytest.raises(CatalogError, match="pickle"):
            validate_model(model)
    else:
        message = ""
        try:
            validate_model(model)
        except CatalogError as exc:
            message = str(exc)
        assert "pickle" not in message
