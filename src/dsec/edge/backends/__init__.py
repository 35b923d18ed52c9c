"""Sandbox backends and the registry that builds them by name.

``make_backend("simulated")`` and ``make_backend("fncall")`` are built in. Any other name
``N`` is looked up lazily as the module ``dsec.edge.backends.N`` (a package is fine),
which must expose ``make_backend(**opts) -> Backend``; so the container backend plugs in
by existing, without this module knowing its internals. Third parties can also call
:func:`register_backend`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dsec.edge.backend import Backend
from dsec.errors import InvalidArgument

__all__ = ["DISK_POOLED", "LAYERED", "BackendFactory", "known_backends", "make_backend",
           "register_backend"]

BackendFactory = Callable[..., Backend]

_FACTORIES: dict[str, BackendFactory] = {}
# Names tried as lazily imported modules when not registered (listed in error messages).
_LAZY = ("container", "runc", "gvisor", "vm")
# Backends whose sandboxes start from the node's layer store (the isolation tiers, issue
# 21): each gets a root dir of its own (``<state-dir>/<name>``) and the ONE images object
# of its node (``images=``: a layer is mounted once, whichever tier's sandbox reads it).
LAYERED = ("container", "gvisor", "vm")
# ... of which those keeping their sandboxes' upper layers in a btrfs disk pool of their
# own (``default_disk_bytes``/``disk_pool_bytes``; the vm tier's scratch disk is a file
# per sandbox, sized by the spec).
DISK_POOLED = ("container", "gvisor")


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``make_backend(name, **opts)`` call ``factory(**opts)``."""
    _FACTORIES[name] = factory


def _simulated(**opts: Any) -> Backend:
    from dsec.edge.backends.simulated import SimulatedBackend

    return SimulatedBackend(**opts)


def _fncall(**opts: Any) -> Backend:
    from dsec.edge.backends.fncall import FncallBackend

    return FncallBackend(**opts)


register_backend("simulated", _simulated)
register_backend("fncall", _fncall)


def known_backends() -> list[str]:
    return sorted(set(_FACTORIES) | set(_LAZY))


def make_backend(name: str, **opts: Any) -> Backend:
    """Build the backend called ``name`` with keyword options ``opts``."""
    factory = _FACTORIES.get(name)
    if factory is None:
        if not name.isidentifier():
            raise InvalidArgument(f"unknown backend {name!r}; known: {', '.join(known_backends())}")
        try:
            mod = importlib.import_module(f"dsec.edge.backends.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"dsec.edge.backends.{name}":
                raise
            raise InvalidArgument(
                f"unknown backend {name!r}; known: {', '.join(known_backends())}"
                + (" (not installed in this build)" if name in _LAZY else ""),
                backend=name) from exc
        factory = getattr(mod, "make_backend", None)
        if factory is None:
            raise InvalidArgument(
                f"backend module dsec.edge.backends.{name} has no make_backend(**opts)",
                backend=name)
    try:
        return factory(**opts)
    except TypeError as exc:
        raise InvalidArgument(f"bad options for backend {name!r}: {exc}", backend=name) from exc
    except KeyError as exc:
        raise InvalidArgument(f"backend {name!r} needs the option {exc.args[0]!r}",
                              backend=name) from exc
