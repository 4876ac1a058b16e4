import sys
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tandem.core.engine import Engine  # noqa: E402

_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_original_init = Engine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _engines.add(self)


Engine.__init__ = _tracking_init


@pytest.fixture(autouse=True)
def all_blocks_returned():
    """After every test, each idle engine holds no KV blocks and its books balance."""
    yield
    for engine in list(_engines):
        engine.scheduler.check_invariants()
        if not engine.has_unfinished_requests():
            assert engine.allocator.all_free(), "an idle engine still holds KV blocks"
