"""What lens_parallel keeps on an object of the user's (a bridge): made once for it, in the object's own dictionary
under one name, so that it lives and dies with the object and is found without a table keyed by modules.

A copy of the object (``copy.deepcopy``, pickling) starts with nothing kept: each thing is made again for the copy
when first asked for (a lock cannot be copied, and what was read off the original is the copy's to read).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NAME = "_lens_parallel_kept"
_MAKING = threading.RLock()


class _Kept(dict[str, Any]):
    """The things kept on one object, by key; empty in any copy of it."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Kept:
        return _Kept()

    def __reduce__(self) -> tuple[type[_Kept], tuple[()]]:
        return _Kept, ()


def kept(owner: Any, key: str, make: Callable[[], T]) -> T:
    """What is kept on ``owner`` under ``key``, made by ``make()`` the first time it is asked for (once, also when
    several threads ask at once)."""
    store = vars(owner).get(_NAME)
    if store is None or key not in store:
        with _MAKING:
            store = vars(owner).setdefault(_NAME, _Kept())
            if key not in store:
                store[key] = make()
    found: T = store[key]
    return found
