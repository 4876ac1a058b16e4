import os
import sys
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tandem.core.engine import Engine  # noqa: E402
from tandem.kernels import native  # noqa: E402
from tandem.kernels.cpu_features import cpu_info  # noqa: E402

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


@pytest.fixture(params=native.VARIANT_NAMES)
def kernels(request):
    """Each kernel variant this CPU runs (skipped, naming the missing features, where it cannot).
    Where a compiler exists, a variant that fails to build fails the test: it is not skipped."""
    isa = native.variant(request.param)
    missing = [f for f in isa.requires if f not in cpu_info().features]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for the {isa.name} kernels")
    if os.environ.get("TANDEM_NO_KERNELS") or native._compiler() is None:
        pytest.skip("no C compiler (or TANDEM_NO_KERNELS): the kernels are not built here")
    return native.load(isa.name)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """One tiny random model per family ("llama", "gemma3"), saved once for the session."""
    from tiny_models import save_tiny

    dirs = {}
    for family in ("llama", "gemma3"):
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        save_tiny(family, d)
        dirs[family] = str(d)
    return dirs


@pytest.fixture(scope="session")
def default_llm():
    """The embedded default model in float32 with the weights as stored (the mode the references
    were made in; ``--quantization auto`` would choose another), chunked in 8-token pieces so that
    prompts mix with other prompts' decodes. Loaded once for the session: it takes seconds."""
    from tandem import LLM

    return LLM(dtype="float32", quantization="none", device="cpu", max_model_len=512, policy="chunked",
               max_num_batched_tokens=8)

