"""What this process holds open, as the kernel lists it (Linux's /proc/self/fd)."""

from __future__ import annotations

import os


def descriptors_open_on(path) -> list[str]:
    """This process's descriptors open on ``path``."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                fds.append(fd)
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return fds
