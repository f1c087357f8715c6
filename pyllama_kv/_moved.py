"""Old module paths of before the folders (issue 31) keep working for one release: each is a
shim that warns once and makes the old name the new module itself (``sys.modules``), so that
``import pyllama_kv.context`` and ``pyllama_kv.core.context`` are one module object."""
from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` an alias of ``new``, with a DeprecationWarning at the importer's line."""
    warnings.warn(f"{old} has moved to {new}; the old path works until the next release", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
