"""The tree shows the layers, and the imports keep to them: the queue core and the crawl know
nothing of Dagster, the Dagster layer nothing of the demo."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# folder -> module prefixes its files must not import
RULES = {
    "tq_pipelines/queue": ("dagster", "tq_pipelines.defs", "tq_pipelines.crawl", "tq_pipelines_demo"),
    "tq_pipelines/db": ("dagster", "tq_pipelines.defs", "tq_pipelines.crawl", "tq_pipelines_demo"),
    "tq_pipelines/crawl": ("dagster", "tq_pipelines.defs", "tq_pipelines_demo"),
    "tq_pipelines/handlers": ("dagster", "tq_pipelines.defs", "tq_pipelines_demo"),
    "tq_pipelines/defs": ("tq_pipelines_demo",),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("folder", sorted(RULES))
def test_a_layer_imports_nothing_above_it(folder: str):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no module in {folder}"
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files
        for module in sorted(imports(path))
        if any(module == banned or module.startswith(banned + ".") for banned in RULES[folder])
    ]
    assert wrong == []
