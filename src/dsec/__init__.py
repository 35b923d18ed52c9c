"""dsec: elastic sandboxes for agentic reinforcement learning."""

from dsec.errors import DsecError

__version__ = "0.1.0"
__all__ = ["DsecError", "__version__"]
