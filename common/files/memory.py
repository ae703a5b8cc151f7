"""What this machine's memory can hold: a request that needs more than it has available is
refused in one line saying what it would need, before anything big is allocated, instead of dying
in the allocator (or being killed by the kernel) minutes into the work. The estimates of what a
request needs live with the requests (common/app/resources.py, common/porting/onnx_file.py)."""

from __future__ import annotations

import os

from transformer_rosetta.errors import RosettaError

GIB = 1 << 30
# The share of the available memory a request may plan to use; the rest is the frameworks' own
# (their runtimes, compiled code, allocator slack), which these estimates do not count.
USABLE_FRACTION = 0.8


class ResourceError(RosettaError):
    """A request that needs more memory than this machine has available."""


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take now (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: let the allocator decide


def fits_problem(needed: int, what: str) -> str | None:
    """What is wrong with planning `needed` bytes (more than the usable share of the available
    memory), or None when they fit."""
    limit = int(available_memory() * USABLE_FRACTION)
    if needed <= limit:
        return None
    return (
        f"{what} needs about {needed / GIB:,.1f} GiB of memory; this machine has "
        f"{limit / GIB:,.1f} GiB to spare"
    )


def check_fits(needed: int, what: str) -> None:
    """Refuse `needed` bytes when they exceed the usable share of the available memory."""
    problem = fits_problem(needed, what)
    if problem is not None:
        raise ResourceError(problem)
