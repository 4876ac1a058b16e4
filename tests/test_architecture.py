"""Rules that keep the layout honest: a torch-free core, no import cycles, models independent of
the runner, CLI choices that are their registries, and small modules."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).parent
MAX_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every tandem module ``path`` imports, wherever the import sits (module level, inside a
    function or under TYPE_CHECKING: a cycle hidden there is still a cycle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.startswith("tandem") and name in modules:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # `from tandem.x import y` names the module tandem.x.y when y is one; else tandem.x
        deps = _imports(path, modules)
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_inside_tandem():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_never_import_the_runner_server_or_bench():
    for name, deps in _graph().items():
        if name.startswith("tandem.models"):
            bad = {d for d in deps if d.startswith(("tandem.runner", "tandem.server", "tandem.bench"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_core_config_and_simulator_import_no_torch():
    core = sorted(n for n in _modules() if n.startswith("tandem.core"))
    names = [*core, "tandem.config", "tandem.sim", "tandem.latency"]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "bad = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"imported {done.stdout.strip()}"


def _choices(parser: argparse.ArgumentParser, command: str) -> dict[str, tuple]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: tuple(a.choices) for a in sub.choices[command]._actions if a.choices}


def test_every_cli_choice_list_is_its_registry():
    from tandem.bench.config import BACKENDS
    from tandem.bench.scenarios import SCENARIOS
    from tandem.bench.workload import DATASETS, DISTS, PROCESSES
    from tandem.cli import build_parser
    from tandem.config import DEVICES, DTYPES, QUANTIZATIONS
    from tandem.core.policies import POLICY_REGISTRY
    from tandem.ops.modes import KERNEL_MODES

    parser = build_parser()
    engine = {"policy": tuple(POLICY_REGISTRY), "kernels": tuple(KERNEL_MODES), "dtype": DTYPES,
              "device": DEVICES, "quantization": QUANTIZATIONS}
    for command in ("generate", "serve", "bench", "compare", "tune", "simulate", "calibrate"):
        choices = _choices(parser, command)
        for dest, registry in engine.items():
            assert choices.get(dest, registry) == registry, (command, dest)
    bench = _choices(parser, "bench")
    assert bench["backend"] == BACKENDS
    assert (bench["dataset_name"], bench["random_dist"], bench["arrival"]) == (DATASETS, DISTS, PROCESSES)
    for command in ("compare", "tune"):
        assert _choices(parser, command)["scenario"] == tuple(SCENARIOS)
    assert _choices(parser, "serve")["policy"] == tuple(POLICY_REGISTRY)


def test_modules_stay_small_or_say_why():
    for name, path in _modules().items():
        lines = path.read_text().count("\n")
        if lines > MAX_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "Longer than" in doc, f"{name}: {lines} lines and its docstring does not say why"
