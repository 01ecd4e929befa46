"""Where the planner's compiled kernels are cached: somewhere writable, so compiling happens once.

Numba caches beside the source (``__pycache__``) or, when the package folder is not writable (a wheel in a
read-only site-packages), in the user's cache folder. Where neither is writable (a read-only home in a
container) and ``NUMBA_CACHE_DIR`` is unset, the cache goes to a per-user folder under the system's temporary
folder instead of failing at import.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

__all__ = ["fallback_cache_dir", "use_writable_cache"]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def fallback_cache_dir(package_dir: Path, user_cache_dir: Path) -> Path | None:
    """The folder to cache in, or None when numba's own choices (package or user cache) are writable."""
    if _writable(package_dir / "__pycache__") or _writable(user_cache_dir):
        return None
    return Path(tempfile.gettempdir()) / f"flashcp-numba-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _user_cache_dir() -> Path:
    """Numba's user-wide cache folder (``appdirs.user_cache_dir('numba')``) on Linux and macOS."""
    try:
        if sys.platform == "darwin":
            return Path.home() / "Library" / "Caches" / "numba"
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
    except (RuntimeError, KeyError):  # no home folder
        return Path(os.devnull)


def use_writable_cache() -> None:
    """Point numba at a writable cache folder when it would find none (before any kernel is defined)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    folder = fallback_cache_dir(Path(__file__).parent, _user_cache_dir())
    if folder is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(folder)  # read by numba when it is imported
    numba = sys.modules.get("numba")
    if numba is not None:
        numba.config.CACHE_DIR = str(folder)
