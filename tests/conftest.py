"""Shared fixtures. Tests that need root or a kernel feature use ``requires_root``."""

from __future__ import annotations

import os

import pytest

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
