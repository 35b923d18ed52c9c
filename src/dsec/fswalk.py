"""``os.walk`` without recursion.

Why: Python 3.11's ``os.walk`` recurses once per directory level (3.12 made it
iterative), so a tree deeper than the interpreter's recursion limit (~1,000) - a
sandbox's ``mkdir d; cd d`` loop, a few MB of /tmp or of its overlay upper, or a nested
sandbox's cgroups - makes every walk of it raise RecursionError (red team 22, B3: the
same hole in ``dsec.rmtree``). Trees dsec walks that a tenant shapes go through
:func:`walk`: same tuples, same top-down pruning, symlinks never followed, errors
skipped as ``os.walk`` does by default (a path past PATH_MAX - ENAMETOOLONG - is such
an error: it is skipped, not fatal).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

__all__ = ["walk"]


def walk(top: str, *, topdown: bool = True) -> Iterator[tuple[str, list[str], list[str]]]:
    """``(dirpath, dirnames, filenames)`` for ``top`` and every directory below it, as
    ``os.walk(top, topdown, followlinks=False)`` yields them (top-down: a caller may
    prune ``dirnames`` in place), with an explicit stack instead of recursion; one
    difference: a symlink is always in ``filenames`` (``os.walk`` lists one to a
    directory in ``dirnames``, stat-ing through it). Memory: the names still to visit."""
    stack: list[tuple[str, list[str], list[str]] | str] = [top]
    while stack:
        item = stack.pop()
        if not isinstance(item, str):       # bottom-up: children done, yield the parent
            yield item
            continue
        dirs: list[str] = []
        files: list[str] = []
        try:
            with os.scandir(item) as it:
                for e in it:
                    try:
                        is_dir = e.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else files).append(e.name)
        except OSError:
            continue
        if topdown:
            yield item, dirs, files
            stack.extend(os.path.join(item, d) for d in reversed(dirs))
        else:
            stack.append((item, dirs, files))
            stack.extend(os.path.join(item, d) for d in reversed(dirs))
