"""Engine installs: an engine in its own virtual environment, made with uv,
pinned so that every node resolves the same files (``docs/engines.md``,
Engine installs).

An :class:`EngineRecipe` names the engine it provides, pinned requirements
(``name==version`` each, no options), the PyPI cut-off ``exclude_newer``
(an RFC 3339 time: uv ignores every file uploaded later, so a node
installing next month gets the same dependencies as one installing today),
an optional wheel index (a GPU build) and a probe: a command run from the
new environment whose output must show the pinned version.

:func:`install` makes ``ENGINES_DIR/<engine>-<version>[-<variant>]/``::

    uv venv --python PY ENGINES_DIR/KEY/venv
    uv pip install --python ENGINES_DIR/KEY/venv/bin/python \\
        --exclude-newer T [--index-url URL --extra-index-url PYPI] PKG==VER …
    ENGINES_DIR/KEY/venv/bin/EXE PROBE-ARGS…      # must exit 0 showing VER

and writes ``installed.json`` beside the environment **only after the probe
passed**. :func:`installed_engines` reads those markers: an environment
without one (an install that failed, or was killed half-way) is never
advertised, and the next install starts it afresh. Failures raise
:class:`InstallFailed` naming the step and the tool's last words.

Recipes are in :data:`RECIPES`: ``vllm`` (vLLM 0.33.0 from PyPI, CUDA 13
build, dependencies as PyPI was one day after its release) and
``llamacpp-cu128`` (llama.cpp's server through xllamacpp's CUDA 12.8 wheel
from xllamacpp's own index, run by the bundled launcher; for nodes with an
NVIDIA card).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs
import cattrs
import orjson
import trio

from llmgw import errors

__all__ = [
    "MARKER",
    "RECIPES",
    "EngineRecipe",
    "InstallFailed",
    "InstalledEngine",
    "install",
    "installed_engines",
]

log = logging.getLogger("llmgw.agent.installs")

#: The file that says an environment installed and passed its probe.
MARKER: Final = "installed.json"
#: How long uv may take for one step, in seconds (vLLM is about 8 GB).
INSTALL_TIMEOUT_S: Final = 3600.0
#: How long a probe may take, in seconds (``vllm --version`` imports torch).
PROBE_TIMEOUT_S: Final = 300.0
#: The most of a tool's output kept for a failure's reason, in lines.
REASON_LINES: Final = 6

_PINNED: Final = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+$"
)
_KEY: Final = re.compile(r"^[a-z0-9][a-z0-9.+_-]*$")
_TIME: Final = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


class InstallFailed(errors.AgentError):
    """An engine could not be installed, or its probe failed; the message
    names the engine, the step and why. Attributes: ``engine``, ``step``
    (``venv``, ``install``, ``probe``, ``recipe``), ``reason``."""

    def __init__(self, engine: str, step: str, reason: str) -> None:
        super().__init__(f"engine {engine}: {step} failed: {reason}")
        self.engine = engine
        self.step = step
        self.reason = reason


@attrs.frozen(kw_only=True)
class EngineRecipe:
    """How to install one engine.

    Attributes:
        engine: the adapter it provides (``vllm``, ``llamacpp``).
        version: the pinned release, which the probe's output must show.
        packages: requirements, each ``name==version`` (extras allowed); no
            options, no URLs, no files.
        exclude_newer: uv's cut-off, ``YYYY-MM-DDTHH:MM:SSZ``.
        python: the interpreter ``uv venv --python`` gets (``3.12``, a path).
        executable: what the adapter runs, in the environment's ``bin/``.
        probe_args: the probe's arguments after ``executable``.
        index_url: a wheel index tried before PyPI (a GPU build); "" = PyPI.
        variant: the build (``cu128``), part of the directory name.
        needs_gpu: install only on a node with an NVIDIA card.
        no_deps: install exactly ``packages`` and nothing else (a wheel with
            no dependencies, from an index that publishes no upload times,
            where ``exclude_newer`` cannot apply; the ``==`` pin is then
            the whole resolution).
        launcher_paths: put the agent's own packages behind the
            environment's (a ``.pth`` file), so the bundled launcher
            (``python -m llmgw.engines.llamacpp``) runs there with the
            environment's build of its engine.
    """

    engine: str
    version: str
    packages: tuple[str, ...]
    exclude_newer: str
    python: str = "3.12"
    executable: str
    probe_args: tuple[str, ...] = ("--version",)
    index_url: str = ""
    variant: str = ""
    needs_gpu: bool = False
    no_deps: bool = False
    launcher_paths: bool = False

    @property
    def key(self) -> str:
        """The directory name: ``vllm-0.33.0``, ``llamacpp-2026.10.11549-cu128``."""
        return "-".join(p for p in (self.engine, self.version, self.variant) if p)

    def problems(self) -> list[str]:
        """What is wrong with the recipe (empty when nothing)."""
        found = []
        if not _KEY.match(self.key):
            found.append(f"name {self.key!r} may hold only a-z 0-9 . + _ -")
        if not self.packages:
            found.append("no packages")
        for pkg in self.packages:
            if not _PINNED.match(pkg):
                found.append(f"{pkg!r} is not pinned as name==version (options and URLs refused)")
        if not (self.no_deps and not self.exclude_newer) and not _TIME.match(self.exclude_newer):
            found.append(f"exclude_newer {self.exclude_newer!r} is not YYYY-MM-DDTHH:MM:SSZ")
        if not self.executable or "/" in self.executable:
            found.append(f"executable {self.executable!r} must be a name in the environment")
        if self.index_url and not self.index_url.startswith("https://"):
            found.append(f"index_url {self.index_url!r} is not https://")
        return found


#: The recipes an agent knows, by name.
RECIPES: Final[Mapping[str, EngineRecipe]] = {
    # vLLM 0.33.0 was uploaded to PyPI 2026-11-02T10:13Z; dependencies as
    # PyPI was a day later. Its PyPI wheel is the CUDA 13 build (driver
    # >= 580); nodes that cannot run it need the cu129 build from vLLM's
    # GitHub release (not installed automatically, docs/engines.md).
    "vllm": EngineRecipe(
        engine="vllm",
        version="0.33.0",
        packages=("vllm==0.33.0",),
        exclude_newer="2026-11-03T10:14:00Z",
        python="3.12",
        executable="vllm",
        probe_args=("--version",),
        needs_gpu=True,
    ),
    # llama.cpp on NVIDIA cards: xllamacpp's CUDA 12.8 wheel of the version
    # uv.lock pins for the CPU build, from xllamacpp's wheel index (which
    # gives no upload times; the wheel has no dependencies), run by the
    # bundled launcher with this environment's python.
    "llamacpp-cu128": EngineRecipe(
        engine="llamacpp",
        version="2026.10.11549",
        variant="cu128",
        packages=("xllamacpp==2026.10.11549",),
        exclude_newer="",
        no_deps=True,
        python=sys.executable,
        executable="python",
        probe_args=("-c", "import xllamacpp; print(xllamacpp.__version__)"),
        index_url="https://xorbitsai.github.io/xllamacpp/whl/cu128",
        needs_gpu=True,
        launcher_paths=True,
    ),
}


@attrs.frozen(kw_only=True)
class InstalledEngine:
    """An environment that installed and passed its probe (``installed.json``).

    Attributes:
        engine, version, variant: from its recipe.
        key: its directory name.
        executable: the absolute path the adapter runs.
        probe_output: the probe's first output line showing the version.
    """

    engine: str
    version: str
    variant: str = ""
    key: str
    executable: str
    probe_output: str = ""


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-REASON_LINES:]) or "no output"


async def _run(argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
    """``(exit code, stdout and stderr)``; -1 and the reason when it could not
    run or ran past ``timeout_s``."""
    with trio.move_on_after(timeout_s) as scope:
        try:
            done = await trio.run_process(
                list(argv),
                check=False,
                capture_stdout=True,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            return -1, f"cannot run {argv[0]}: {errors.describe(exc)}"
    if scope.cancelled_caught:
        return -1, f"{argv[0]} ran past {timeout_s:g} s"
    return done.returncode, done.stdout.decode(errors="replace")


def _launcher_pth(venv: Path) -> None:
    """A ``.pth`` in the environment that appends the agent's own package
    folders (``llmgw``, ``attrs``, ``orjson``) after its site-packages."""
    import attrs as attrs_module
    import orjson as orjson_module

    import llmgw.engines

    folders = {
        str(Path(next(iter(llmgw.engines.__path__))).parent.parent),
        str(Path(attrs_module.__file__).parent.parent),
        str(Path(orjson_module.__file__).parent.parent),
    }
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "llmgw-launcher.pth").write_text("\n".join(sorted(folders)) + "\n")


async def install(
    recipe: EngineRecipe,
    engines_dir: Path,
    *,
    uv: str = "uv",
    install_timeout_s: float = INSTALL_TIMEOUT_S,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> InstalledEngine:
    """Install ``recipe`` into ``engines_dir/<recipe.key>/venv`` and probe it
    (module docstring); an install already probed is returned as it is.

    Raises:
        InstallFailed: the recipe is not acceptable (``recipe``), uv failed
            (``venv``, ``install``: uv's last lines), or the probe did not
            exit 0 showing ``recipe.version`` (``probe``). The half-made
            environment is removed.
    """
    problems = recipe.problems()
    if problems:
        raise InstallFailed(recipe.engine, "recipe", "; ".join(problems))
    home = engines_dir / recipe.key
    done = _read_marker(home)
    if done is not None:
        return done
    venv = home / "venv"
    await trio.to_thread.run_sync(lambda: shutil.rmtree(home, ignore_errors=True))
    home.mkdir(parents=True)
    try:
        code, out = await _run(
            [uv, "venv", "--quiet", "--python", recipe.python, str(venv)], install_timeout_s
        )
        if code != 0:
            raise InstallFailed(recipe.engine, "venv", _tail(out))
        argv = [uv, "pip", "install", "--python", str(venv / "bin" / "python")]
        if recipe.exclude_newer:
            argv += ["--exclude-newer", recipe.exclude_newer]
        if recipe.no_deps:
            argv.append("--no-deps")
        if recipe.index_url:
            argv += [
                "--index-url",
                recipe.index_url,
                "--extra-index-url",
                "https://pypi.org/simple",
            ]
        argv += list(recipe.packages)
        log.info("installing %s: %s", recipe.key, " ".join(argv))
        code, out = await _run(argv, install_timeout_s)
        if code != 0:
            raise InstallFailed(recipe.engine, "install", _tail(out))
        if recipe.launcher_paths:
            _launcher_pth(venv)
        executable = venv / "bin" / recipe.executable
        code, out = await _run([str(executable), *recipe.probe_args], probe_timeout_s)
        if code != 0:
            raise InstallFailed(recipe.engine, "probe", f"exit {code}: {_tail(out)}")
        if recipe.version not in out:
            raise InstallFailed(
                recipe.engine, "probe", f"did not show version {recipe.version}: {_tail(out)}"
            )
    except BaseException:
        await trio.to_thread.run_sync(lambda: shutil.rmtree(home, ignore_errors=True))
        raise
    first = next((line.strip() for line in out.splitlines() if recipe.version in line), "")
    result = InstalledEngine(
        engine=recipe.engine,
        version=recipe.version,
        variant=recipe.variant,
        key=recipe.key,
        executable=str(executable),
        probe_output=first[:200],
    )
    marker = home / MARKER
    marker.with_suffix(".tmp").write_bytes(orjson.dumps(cattrs.unstructure(result)))
    marker.with_suffix(".tmp").replace(marker)
    log.info("installed %s (%s)", recipe.key, first)
    return result


def _read_marker(home: Path) -> InstalledEngine | None:
    try:
        found = cattrs.structure(orjson.loads((home / MARKER).read_bytes()), InstalledEngine)
    except (OSError, ValueError, cattrs.BaseValidationError, TypeError, KeyError):
        return None
    return found if Path(found.executable).is_file() else None


def installed_engines(engines_dir: Path) -> list[InstalledEngine]:
    """The environments under ``engines_dir`` that installed and passed their
    probe, by directory name; ones without a readable ``installed.json`` or
    whose executable is gone are left out."""
    try:
        homes = sorted(p for p in engines_dir.iterdir() if p.is_dir())
    except OSError:
        return []
    return [found for home in homes if (found := _read_marker(home)) is not None]
