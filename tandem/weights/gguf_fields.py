"""Reading GGUF metadata fields: scalars, string and numeric arrays, optional token ids.

``gguf.ReaderField.contents()`` builds one Python object per array element, which costs
seconds for a 262k-entry vocabulary; the array readers here take the elements straight from
the file mapping instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["array_length", "numeric_array", "optional_id", "scalar", "string_array"]


def _field(reader: "gguf.GGUFReader", key: str):
    return reader.fields.get(key)


def scalar(reader: "gguf.GGUFReader", key: str, default: Any = None) -> Any:
    """The field's value (a list for an array field), or ``default`` when it is absent."""
    field = _field(reader, key)
    if field is None or not field.types:
        return default
    from gguf import GGUFValueType

    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if field.types[0] == GGUFValueType.ARRAY:
        return field.contents()
    value = field.parts[-1].tolist()
    return value[0] if isinstance(value, list) else value


def array_length(reader: "gguf.GGUFReader", key: str) -> int | None:
    field = _field(reader, key)
    return None if field is None else len(field.data)


def string_array(reader: "gguf.GGUFReader", key: str) -> list[str] | None:
    field = _field(reader, key)
    if field is None:
        return None
    parts = field.parts
    # Same as field.contents(), minus its per-call overhead; ~0.25 s for 262k entries.
    return [parts[i].tobytes().decode("utf-8", errors="replace") for i in field.data]


def numeric_array(reader: "gguf.GGUFReader", key: str) -> np.ndarray | None:
    field = _field(reader, key)
    if field is None:
        return None
    if not field.data:
        return np.zeros(0)
    parts = field.parts
    first, last = parts[field.data[0]], parts[field.data[-1]]
    count = len(field.data)
    # GGUFReader keeps every element as its own one-item view of the file mapping; when they
    # sit back to back (they always do in a well-formed file) take the whole run in one view.
    base = getattr(reader, "data", None)
    if isinstance(base, np.ndarray) and base.dtype == np.uint8 and first.size == 1:
        itemsize = first.dtype.itemsize
        start = first.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        end = last.__array_interface__["data"][0] - base.__array_interface__["data"][0] + itemsize
        if 0 <= start and end <= base.size and end - start == count * itemsize:
            values = np.array(base[start:end].view(first.dtype))
            if values[:1].tobytes() == first.tobytes() and values[-1:].tobytes() == last.tobytes():
                return values
    # Fallback: concatenate the one-item views (still ~10x faster than field.contents()).
    return np.concatenate([parts[i] for i in field.data])


def optional_id(reader: "gguf.GGUFReader", key: str, n_vocab: int) -> int | None:
    """A token id field, or ``None`` when it is absent or outside the vocabulary."""
    value = scalar(reader, key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None
