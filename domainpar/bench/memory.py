"""This process's memory as the kernel counts it (Linux ``/proc/self``): a line
of ``status`` (VmRSS, VmHWM, VmData), the resident high-water mark reset, and
freed heap memory handed back. The conv benchmark's and the demo budget's
memory figures both read them here."""
from __future__ import annotations

import ctypes
import gc

STATUS = "/proc/self/status"


def status_kib(field: str) -> int | None:
    """Local. The ``field`` line of ``/proc/self/status`` in KiB (``VmRSS``,
    ``VmHWM``, ...); None where there is no such file or line."""
    try:
        with open(STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Local. Reset the kernel's high-water mark of this process's resident size
    to its resident size now (VmHWM and ru_maxrss; Linux 4.0 or later); False
    where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim() -> None:
    """Local. Collect Python's garbage and hand the memory the C allocator keeps
    after frees back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
