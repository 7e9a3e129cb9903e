"""The sim engine package's modules: their layering and the request error."""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw.engines.sim
from llmgw.engines.sim.request import RequestError
from llmgw.errors import InvalidInput, LlmgwError

#: Each module may import only those before it.
LAYERS = (
    "config",
    "request",
    "answers",
    "shapes",
    "pacing",
    "metrics",
    "app",
    "serve",
    "adapter",
    "__main__",
)


def _sibling_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "llmgw.engines.sim":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("llmgw.engines.sim."):
                names.add(node.module.removeprefix("llmgw.engines.sim."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("llmgw.engines.sim."):
                    names.add(alias.name.removeprefix("llmgw.engines.sim."))
    return names


def test_each_sim_module_imports_only_the_modules_below_it() -> None:
    folder = Path(llmgw.engines.sim.__file__).parent
    found = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    assert found == set(LAYERS)
    assert _sibling_imports(folder / "__init__.py") == set()
    for index, name in enumerate(LAYERS):
        above = _sibling_imports(folder / f"{name}.py") - set(LAYERS[:index])
        assert not above, f"{name} imports {sorted(above)}"


def test_a_request_error_is_invalid_input_with_its_status_and_kind() -> None:
    error = RequestError(413, "request body too large")
    assert isinstance(error, InvalidInput)
    assert isinstance(error, LlmgwError)
    assert isinstance(error, ValueError)
    assert (error.status, error.message, error.kind) == (
        413,
        "request body too large",
        "invalid_request_error",
    )
    assert str(error) == "request body too large"
