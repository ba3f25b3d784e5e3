"""The shared package's layout: the roles import `pdq`, never the other way round (outside the
tools that measure them from outside, `pdq bench` and `pdq chaos`), and its modules live in
folders by concern, with the public client and the config at its top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdq"
ROLES = {"gateway", "scheduler", "prefill_worker", "decode_worker"}
TOOLS = {"bench", "chaos"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_of_the_serving_path_imports_a_role():
    offenders = {str(p.relative_to(ROOT.parent)): sorted(imported_roots(p) & ROLES)
                 for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in TOOLS}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_shared_package_keeps_only_the_client_and_the_config_at_its_top():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py", "client.py", "config.py"]
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {"state", "transport", "engine", "model", "observability", "ops", "cli", "bench", "chaos", "v1"}
