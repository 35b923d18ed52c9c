"""Finding a live object the code under test holds but does not expose (a proxy inside an
app, a dashboard behind a route): a scan of what the garbage collector tracks."""

from __future__ import annotations

import gc
from typing import TypeVar

T = TypeVar("T")


def live_instances(cls: type[T]) -> list[T]:
    """Every tracked object whose type is ``cls`` or a subclass. By ``type(o)``, never
    ``isinstance``: that reads ``o.__class__``, and a weak proxy whose referent is gone
    (other libraries leave them, torch does) raises ReferenceError there (CI, once)."""
    return [o for o in gc.get_objects() if issubclass(type(o), cls)]  # type: ignore[misc]
