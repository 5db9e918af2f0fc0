"""`defs` holds Dagster wiring over `stages`; it must not reach into the demo package."""

import ast
from pathlib import Path

import prx_assets.defs
from prx_assets.demo import funnel as demo_funnel
from prx_assets.stages.report import funnel


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_defs_do_not_import_the_demo():
    defs_dir = Path(prx_assets.defs.__file__).parent
    offenders = {path.name: sorted(m for m in _imported_modules(path)
                                   if m == "prx_assets.demo" or m.startswith("prx_assets.demo."))
                 for path in sorted(defs_dir.rglob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_the_demo_module_still_offers_the_funnel():
    assert demo_funnel.source_funnel is funnel.source_funnel
    assert demo_funnel.Funnel is funnel.Funnel
