"""``sb.run_code(...)``: a stateful Python interpreter per sandbox. The kernel's protocol
and driver live in :mod:`dsec.code` (the E2B layer's code interpreter runs the same
kernel); this module is the SDK's name for them."""

from dsec.code import (
    EXIT_BAD_DIR,
    EXIT_NO_KERNEL,
    KERNEL_DIR,
    KERNEL_PATH,
    KERNEL_SOURCE,
    MAX_CODE_BYTES,
    RESULT_CAP_BYTES,
    CodeError,
    CodeResult,
    Execution,
    restart,
    run_code,
)

__all__ = ["EXIT_BAD_DIR", "EXIT_NO_KERNEL", "KERNEL_DIR", "KERNEL_PATH", "KERNEL_SOURCE",
           "MAX_CODE_BYTES", "RESULT_CAP_BYTES", "CodeError", "CodeResult", "Execution",
           "restart", "run_code"]
