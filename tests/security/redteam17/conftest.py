"""Red team of issue 17/18 (red17): fixtures borrowed from the streams' own suites."""

from tests.edge.lazy.conftest import remote  # noqa: F401  (pytest fixture)
