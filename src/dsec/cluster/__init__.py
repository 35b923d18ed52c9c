"""The composition root: the one floor that knows every other and wires them together.

- :mod:`dsec.cluster.runtime`: ``ClusterConfig``/``ClusterRuntime``, a whole cluster in one
  process (what ``dsec up``, ``dsec apiserver`` and ``LocalCluster`` run);
- :mod:`dsec.cluster.edge_process`: a local edge as a supervised ``dsec edge`` process;
- :mod:`dsec.cluster.local`: ``LocalCluster``, the runtime on a thread (or ``dsec up`` in a
  child process) for tests and notebooks;
- :mod:`dsec.cluster.compose`: :func:`~dsec.cluster.compose.api_service`, the one place an
  apiserver's ``ApiService`` is wired from a store and a control plane;
- :mod:`dsec.cluster.run`: run a runtime in the foreground until SIGINT/SIGTERM.

Nothing below this floor imports it (``pyproject.toml``'s import contracts): the control
plane, the edges and the SDK do not know how they are put together.
"""

from __future__ import annotations

import sys

__all__ = ["DSEC_ARGV"]

#: How this installation runs ``dsec`` in a child process (edges, ``dsec up``): this
#: interpreter with the same ``sys.path`` setup, whatever the ``dsec`` script on $PATH is.
DSEC_ARGV: tuple[str, ...] = (sys.executable, "-c", "from dsec.cli.main import main; main()")
