"""Red teams of issue 21 (gVisor and microVM tiers): shared fixtures."""

from __future__ import annotations

from tests.edge.vm.conftest import boot_files, vm_backend, vm_store  # noqa: F401  (fixtures)
from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
