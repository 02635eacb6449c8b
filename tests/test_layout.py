"""The package's layout holds: stages that follow the book, no stage importing a later one, no import circle,
a few shared tools at the top, and a teaching core that reads like the notebooks (checks live at the doors).

Read from the source with ``ast``: every ``import``, at the top of a module or inside a function.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmscratch"
STAGES = ("text", "model", "training", "finetuning", "alignment", "deployment")  # the book's order
# The code the chapters build by hand, which must read like them: at most 1 raise per 100 lines.
TEACHING_CORE = ("text/bpe.py", "text/tokenizer.py", "model/attention.py", "model/rope.py", "model/norm.py",
                 "model/mlp.py", "model/moe.py", "model/gpt.py", "model/generate.py", "model/losses.py",
                 "model/decode_kernels.py", "training/optim.py")


def module_name(path: Path) -> str:
    name = ".".join(("llmscratch",) + path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """The package's modules that ``path`` imports (a name imported from a package counts as its module when it
    is one, e.g. ``from llmscratch.training import distributed``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            pytest.fail(f"{path}: a relative import; the package imports by full name")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmscratch"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("llmscratch"))
    return {name for name in found if name in MODULES} - {module_name(path), "llmscratch"}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def stage_of(name: str) -> str:
    """The subpackage a module belongs to ("top" for the shared modules, ``assets`` and the package itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES + ("exercises",)) else "top"


RANK = {"top": 0, **{stage: i + 1 for i, stage in enumerate(STAGES)}, "exercises": len(STAGES) + 1}


def test_every_module_is_found():
    assert len(MODULES) > 60 and "llmscratch.model.gpt" in MODULES and "llmscratch.text.tokenizer" in MODULES


def test_no_stage_imports_a_later_one():
    """text < model < training < finetuning < alignment < deployment; the top imports no stage; only the
    exercises (which check every chapter) may import from all of them."""
    upward = [f"{name} -> {other}" for name, others in GRAPH.items() for other in sorted(others)
              if RANK[stage_of(other)] > RANK[stage_of(name)]]
    assert not upward, "a module imports a later stage:\n" + "\n".join(upward)


def test_no_import_circle():
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(GRAPH[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_top_holds_a_few_shared_tools():
    top = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
    assert len(top) <= 12, top
    stages = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file())
    assert set(STAGES) <= set(stages), stages


@pytest.mark.parametrize("relative", TEACHING_CORE)
def test_the_teaching_core_reads_like_the_notebooks(relative):
    """At most one ``raise`` per 100 lines: arguments are checked where they enter (the configs,
    ``llmscratch.model.checks``, ``llmscratch.text.checks``), not in the code the chapters build by hand."""
    source = (PACKAGE / relative).read_text(encoding="utf-8")
    raises = sum(isinstance(node, ast.Raise) for node in ast.walk(ast.parse(source)))
    lines = len(source.splitlines())
    assert raises * 100 <= max(lines, 100), f"{relative}: {raises} raise statements in {lines} lines"
