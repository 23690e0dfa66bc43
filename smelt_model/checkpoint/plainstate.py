"""Training state without pickle: tensors in a safetensors file, everything else in JSON.

:func:`dump` splits a nested state (dicts, lists, tuples, tensors, numpy arrays, numbers,
strings, None) into a JSON document and a ``{name: tensor}`` dict for safetensors;
:func:`load` reads the two files back and rebuilds it. Reading runs no code from the files:
the JSON is parsed by :mod:`json`, every value is checked against the grammar below, and the
tensors come from safetensors (a JSON header and raw bytes).

The JSON grammar: ``null``, booleans, integers, strings and finite floats stand for
themselves; an array is a list; every object has exactly one key, its tag:

* ``{"dict": [[key, value], ...]}``: a dict (keys are strings or integers);
* ``{"tuple": [...]}``: a tuple;
* ``{"tensor": "name"}``: the tensor ``name`` of the safetensors file;
* ``{"ndarray": {"dtype": "uint32", "shape": [624], "data": [...]}}``: a numeric numpy array;
* ``{"float": "nan" | "inf" | "-inf"}``: a float JSON cannot spell.

Any other content is refused with a :class:`StateFileError` naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from safetensors.torch import load_file

__all__ = ["StateFileError", "dump", "load", "encode", "decode", "read_json", "first_line"]

FORMAT = "smelt-train-state/1"
#: numpy dtypes an ndarray entry may have (numbers only: no objects, no strings)
_NDARRAY_KINDS = "biuf"
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class StateFileError(ValueError):
    """A state file that is not what :func:`dump` writes (the message names the file)."""


def encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON value of ``obj``; its tensors are added to ``tensors`` under fresh names."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous()
        return {"tensor": name}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NDARRAY_KINDS:
            raise TypeError(f"cannot store a numpy array of dtype {obj.dtype}")
        return {
            "ndarray": {
                "dtype": obj.dtype.str,
                "shape": list(obj.shape),
                "data": obj.reshape(-1).tolist(),
            }
        }
    if isinstance(obj, np.generic):
        return encode(obj.item(), tensors)
    if isinstance(obj, tuple):
        return {"tuple": [encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"cannot store a dict key of type {type(k).__name__}")
            items.append([k, encode(v, tensors)])
        return {"dict": items}
    raise TypeError(f"cannot store a value of type {type(obj).__name__}")


def decode(value: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """Rebuild what :func:`encode` produced; ``ValueError`` for anything outside the grammar."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: a bare non-finite float")
        return value
    if isinstance(value, list):
        return [decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{where}: expected a value or an object with one tag")
    ((tag, body),) = value.items()
    if tag == "dict":
        if not isinstance(body, list):
            raise ValueError(f"{where}: a dict must be a list of [key, value] pairs")
        out = {}
        for i, pair in enumerate(body):
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and isinstance(pair[0], (str, int))
                and not isinstance(pair[0], bool)
            ):
                raise ValueError(f"{where}: dict entry {i} is not a [key, value] pair")
            out[pair[0]] = decode(pair[1], tensors, f"{where}.{pair[0]}")
        return out
    if tag == "tuple":
        if not isinstance(body, list):
            raise ValueError(f"{where}: a tuple must be a list")
        return tuple(decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(body))
    if tag == "tensor":
        if not isinstance(body, str) or body not in tensors:
            raise ValueError(f"{where}: names a tensor the tensor file does not hold")
        return tensors[body]
    if tag == "float":
        if body not in _FLOATS:
            raise ValueError(f"{where}: unknown float {body!r}")
        return _FLOATS[body]
    if tag == "ndarray":
        return _ndarray(body, where)
    raise ValueError(f"{where}: unknown tag {tag!r}")


def _ndarray(body: Any, where: str) -> np.ndarray:
    if not (isinstance(body, dict) and set(body) == {"dtype", "shape", "data"}):
        raise ValueError(f"{where}: an ndarray needs exactly dtype, shape and data")
    try:
        dtype = np.dtype(body["dtype"]) if isinstance(body["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NDARRAY_KINDS:
        raise ValueError(f"{where}: ndarray dtype {body['dtype']!r} is not a number type")
    shape, data = body["shape"], body["data"]
    if not (
        isinstance(shape, list)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise ValueError(f"{where}: ndarray shape must be a list of sizes")
    if not (
        isinstance(data, list)
        and len(data) == math.prod(shape)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in data)
    ):
        raise ValueError(f"{where}: ndarray data must be {math.prod(shape)} numbers")
    try:
        return np.array(data, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError):
        raise ValueError(f"{where}: ndarray data do not fit {dtype}") from None


def dump(state: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``(json_bytes, tensors)`` for ``state``: write the first as the JSON file and the
    second with ``safetensors.torch.save_file``."""
    tensors: dict[str, torch.Tensor] = {}
    doc = {"format": FORMAT, "state": encode(state, tensors)}
    seen = set()
    for name, t in tensors.items():  # safetensors stores no two views of one memory
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            tensors[name] = t.clone()
        seen.add(ptr)
    return json.dumps(doc, allow_nan=False).encode(), tensors


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_json(path: Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in the plain file ``path``; one ``error`` naming the file, and ``what``
    it should have been, for anything else (a link, a folder, bad JSON, not an object)."""
    if path.is_symlink() or not path.is_file():
        raise error(f"{path}: not a plain file")
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{path}: not a valid {what} ({first_line(e)})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: not a valid {what} (expected a JSON object)")
    return doc


def load(json_path: Union[str, Path], tensor_path: Union[str, Path]) -> Any:
    """The state written by :func:`dump` into ``json_path`` and ``tensor_path``.

    Raises :class:`StateFileError` naming the file for anything else: unreadable or
    malformed JSON, content outside the grammar, a tensor file that is not safetensors.
    """
    json_path, tensor_path = Path(json_path), Path(tensor_path)
    try:
        tensors = load_file(str(tensor_path))
    except Exception as e:  # safetensors' own error types; the file is not a tensor file
        raise StateFileError(
            f"{tensor_path}: not a readable safetensors file ({first_line(e)})"
        ) from None
    doc = read_json(json_path, "JSON state file", StateFileError)
    if not (doc.get("format") == FORMAT and "state" in doc):
        raise StateFileError(
            f"{json_path}: not a smelt training state (expected format {FORMAT!r})"
        )
    try:
        return decode(doc["state"], tensors)
    except (ValueError, RecursionError) as e:
        raise StateFileError(f"{json_path}: {first_line(e)}") from None
