"""Every script in benchmarks/ imports: a renamed or moved project function breaks a benchmark
at once, not the next time someone runs it (the scripts themselves are too slow for the suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # module level only: main() runs under __name__ == "__main__"
    # the peers' helpers (peer_*.py) are modules of benchmarks/peers.py, not scripts
    if not script.name.startswith("peer_"):
        assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
