"""On-disk cache of GGUF models converted to float32 safetensors plus a tokenizer.

Dequantizing a GGUF file and building its tokenizer takes tens of seconds; loading the cached
result takes a few. A cache entry is built in a temporary directory and renamed into place, and
a manifest written last records each file's size and a digest of sampled pieces, so a partial
or corrupted entry is detected on load and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from tandem.models.spec import ModelSpec
from tandem.paths import default_cache_dir
from tandem.startup import one_time
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_SAMPLE = 1 << 20  # digest 1 MiB ...
_STRIDE = 16 << 20  # ... out of every 16 MiB of a file (the whole of small files)


def _fingerprint(source: Path) -> str:
    st = source.stat()
    key = f"{source.resolve()}|{st.st_size}|{int(st.st_mtime)}|v{FORMAT_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with path.open("rb") as f:
        for offset in range(0, max(size, 1), _STRIDE):
            f.seek(offset)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _valid(entry: Path) -> bool:
    manifest = entry / _MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        for name, info in files.items():
            path = entry / name
            if path.stat().st_size != info["size"] or _digest(path) != info["digest"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def converted_entry(source: Path, cache_dir: Path | None = None) -> Path:
    """The cache directory for ``source`` (a .gguf file), converting it first if needed."""
    root = (cache_dir or default_cache_dir()) / "converted"
    entry = root / f"{source.stem}-{_fingerprint(source)}"
    if entry.is_dir() and _valid(entry):
        return entry
    if entry.exists():
        log.warning("cached conversion at %s is incomplete or corrupted; rebuilding it", entry)
        shutil.rmtree(entry, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        with one_time(f"converting {source.name} into {root}", "once per file: later starts load the converted copy"):
            _convert(source, tmp)
        try:
            tmp.rename(entry)
        except OSError:  # another process finished first
            if not _valid(entry):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def _convert(source: Path, out: Path) -> None:
    from tandem.weights.gguf_file import iter_gguf_weights, open_gguf, spec_from_gguf
    from tandem.weights.gguf_tokenizer import tokenizer_from_gguf

    from tokenizers import Tokenizer as HFTokenizer

    reader = open_gguf(source)
    spec = spec_from_gguf(reader)
    tensors = dict(iter_gguf_weights(reader, spec))
    save_file(tensors, str(out / "model.safetensors"))
    (out / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    tok_spec = tokenizer_from_gguf(reader)
    Tokenizer(
        backend=HFTokenizer.from_str(tok_spec.tokenizer_json),
        bos_token_id=tok_spec.bos_token_id,
        eos_token_ids=tuple(tok_spec.eos_token_ids),
        add_bos_token=tok_spec.add_bos_token,
        chat_template=tok_spec.chat_template,
    ).save(out)
    files = {
        p.name: {"size": p.stat().st_size, "digest": _digest(p)}
        for p in sorted(out.iterdir())
        if p.is_file()
    }
    (out / _MANIFEST).write_text(json.dumps({"version": FORMAT_VERSION, "source": str(source), "files": files}))


def load_spec(entry: Path) -> ModelSpec:
    return ModelSpec.from_dict(json.loads((entry / "spec.json").read_text()))
