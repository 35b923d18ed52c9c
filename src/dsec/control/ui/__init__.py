"""The web dashboard served by the apiserver at ``/ui`` (docs/ui.md)."""

from dsec.control.ui.app import Dashboard

__all__ = ["Dashboard"]
