"""Numba set-up for every flashcp kernel: machine code that is safe to cache on disk and to load back.

Every module that defines kernels imports ``njit`` from here instead of from numba; importing this module
does two things before any kernel is defined.

**Names that cannot collide across processes.** Numba names a compiled function by its qualified name, its
argument types and a number from a per-process counter (``FunctionIdentity._unique_ids``, counting from 1),
and marks it ``linkonce_odr``: when two modules linked together define the same name, LLVM keeps one body.
That is safe inside one process, where the counter makes names unique, but not across the on-disk cache:
numba's own sort closures all share one qualified name (``numba.misc.quicksort.make_quicksort_impl.<locals>
.run_quicksort1``), so ``np.argsort`` compiled as number 35 in one process and ``ndarray.sort`` compiled as
number 35 in another get the same name with different bodies. A kernel compiled in the second process that
calls a cached kernel of the first links both, and one of them runs the other's sort. Reproduction (numba
0.68, before this module): with an empty cache, ``flashcp plan DATA --cp 8 --strategy flashcp`` (caches
``check_batch``, whose plan check sorts positions with ``ndarray.sort``), then ``flashcp plan DATA --cp 8``
(compiles ``flashcp2``, whose kernels call ``np.argsort``): the second process's plan check sorts with
``argsort``'s body and rejects every correct plan ("does not cover every token"); calling the cached
``check_batch`` first and the fresh ``flashcp2`` kernel second instead segfaults. The counter is replaced
by random 62-bit numbers (from ``os.urandom``, so forked workers differ too): names then never repeat,
whatever ran in which process. numba issue 10486 describes the same hazard.

**A cache that cannot serve old code.** Numba keys a cached kernel by the source file of that kernel only, so
a kernel whose callee in another file changed (an upgraded checkout) would load stale machine code. Here
every kernel is cached in one folder named by a hash of the source of every flashcp module that defines
kernels (the modules that import this one), of the modules that decide which kernel a compilation links
(``LINKING_MODULES``: the registry, which ``batch`` reads to compile a strategy's kernel into its batch loop) and
of the Python, numba, llvmlite and numpy versions, so any change compiles afresh into a new folder.
Reproduction of a missing linking module (before it was hashed): edit ``planner/registry.py`` so that
``ring`` names ``llama3_kernel``, and ``flashcp plan DATA --cp 4 --strategy ring --force`` still wrote the
old ring plan, loaded from the cache under the same key. Kernels may read module globals only from such modules (numba
freezes globals at compile time). The folder is, in order of preference:
``$NUMBA_CACHE_DIR/flashcp-<key>`` when the user set ``NUMBA_CACHE_DIR``; ``flashcp/__pycache__/numba-<key>``
beside the package when it is writable (where older keys of the same checkout are removed; each such folder
holds a marker file flashcp wrote, and nothing without it is touched); the user's cache folder
(``~/.cache/flashcp/numba-<key>``); else a per-user folder under the system's temporary folder.

**A cache that cannot stop a run.** Numba unpickles its cache files unguarded and writes them where it
compiles: a truncated index file raised ``UnpicklingError`` in every ``plan`` (an empty one ``EOFError``,
which click reports as a bare ``Aborted!``), and a full disk under the cache failed the command with "No
space left on device", blamed on the dataset. Here a damaged entry is ignored and compiled again, and a
cache that cannot be written is skipped; each is said once per process (``KernelCacheWarning``), naming the
file or the folder.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import shutil
import sys
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import llvmlite
import numba
import numpy as np
from numba.core import bytecode, caching, types
from numba.core.registry import CPUDispatcher

from flashcp.errors import KernelCacheWarning

__all__ = ["cache_folder", "kernel_sources", "njit"]

PACKAGE = Path(__file__).resolve().parent
"""The flashcp package folder: kernels defined in files below it use flashcp's cache folder."""
MARKER = "flashcp-kernel-cache"
"""A file flashcp writes into every cache folder it makes, so that it only ever removes its own."""
_KERNEL_IMPORT = "from flashcp._numba import njit"
LINKING_MODULES = ("planner/registry.py",)
"""Modules (relative to the package) without kernels of their own that decide which kernel is linked into a
compilation: ``batch._dispatcher`` compiles into a strategy's batch loop the kernel ``registry.STRATEGIES`` names."""


class _RandomIds:
    """Endless random 62-bit numbers: numba's function numbers, unique across processes (and forks)."""

    def __iter__(self):
        return self

    def __next__(self) -> int:
        return secrets.randbits(62) | (1 << 62)  # same digit count for every name


def _use_random_function_ids() -> None:
    identity = getattr(bytecode, "FunctionIdentity", None)
    if identity is None or not isinstance(getattr(identity, "_unique_ids", None), (itertools.count, _RandomIds)):
        # numba changed how it numbers functions; plan validation still refuses a plan a clash would spoil
        warnings.warn(f"numba {numba.__version__} numbers compiled functions in a way flashcp does not know; "
                      "kernels loaded from the cache may clash", RuntimeWarning, stacklevel=2)
        return
    identity._unique_ids = _RandomIds()


def kernel_sources() -> list[Path]:
    """The flashcp source files the kernel cache key hashes, sorted.

    Those that define kernels (they import ``njit`` from this module) and the ``LINKING_MODULES``.
    """
    linking = {PACKAGE / name for name in LINKING_MODULES}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if _KERNEL_IMPORT in text or path in linking:
            found.append(path)
    return found


@cache
def cache_key() -> str:
    """Hash of every kernel source file and of the versions that shape machine code (16 hex digits)."""
    digest = hashlib.sha256()
    for part in (sys.version, numba.__version__, llvmlite.__version__, np.__version__):
        digest.update(part.encode() + b"\0")
    for path in kernel_sources():
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _usable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        marker = folder / MARKER
        if not marker.exists():
            marker.write_text("compiled flashcp kernels; safe to delete\n")
    except OSError:
        return False
    return True


def _user_cache_root() -> Path | None:
    try:
        if sys.platform == "darwin":
            return Path.home() / "Library" / "Caches" / "flashcp"
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashcp"
    except (RuntimeError, KeyError):  # no home folder
        return None


def _remove_older_keys(folder: Path) -> None:
    """Remove the in-package cache folders of other keys that flashcp made (marker file inside)."""
    for other in folder.parent.glob("numba-*"):
        if other != folder and other.is_dir() and not other.is_symlink() and (other / MARKER).is_file():
            shutil.rmtree(other, ignore_errors=True)


@cache
def cache_folder() -> Path:
    """The folder every flashcp kernel is cached in (made on first use; see the module docstring)."""
    key = cache_key()
    user_dir = os.environ.get("NUMBA_CACHE_DIR")
    if user_dir:
        folder = Path(user_dir) / f"flashcp-{key}"
        if _usable(folder):
            return folder
    folder = PACKAGE / "__pycache__" / f"numba-{key}"
    if _usable(folder):
        _remove_older_keys(folder)
        return folder
    root = _user_cache_root()
    if root is not None and _usable(root / f"numba-{key}"):
        return root / f"numba-{key}"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"flashcp-numba-{uid}" / f"numba-{key}"


class _KernelCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator for kernels defined in flashcp's own files: ``cache_folder()/<subpackage>``."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        relative = Path(py_file).resolve().parent.relative_to(PACKAGE)
        self._cache_path = str(cache_folder().joinpath(*relative.parts))

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        # the folder is keyed by every kernel source already; the stamp only has to be constant
        return cache_key()

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            Path(py_file).resolve().relative_to(PACKAGE)
        except (ValueError, OSError):
            return None  # not flashcp's: numba's own locators decide
        return super().from_function(py_func, py_file)


_said: set[str] = set()


def _say_once(kind: str, message: str) -> None:
    if kind not in _said:
        _said.add(kind)
        warnings.warn(message, KernelCacheWarning, stacklevel=3)


class _KernelCacheFile(caching.IndexDataCacheFile):
    """Numba's index and data files, read so that a damaged one reads as missing (compiled again)."""

    def _load_index(self):
        try:
            return super()._load_index()
        except OSError:
            raise
        except Exception as e:  # unpickling a truncated or empty file: any error pickle can raise
            _say_once("damaged", f"the kernel cache file {self._index_path} is damaged "
                                 f"({type(e).__name__}); ignoring it and compiling again")
            return {}

    def _load_data(self, name):
        try:
            return super()._load_data(name)
        except OSError:
            raise  # numba reads a missing data file as a miss
        except Exception as e:
            _say_once("damaged", f"the kernel cache file {self._data_path(name)} is damaged "
                                 f"({type(e).__name__}); ignoring it and compiling again")
            return None


class _KernelCache(caching.FunctionCache):
    """Numba's per-function cache over ``_KernelCacheFile``: damage is a miss, a failed write is skipped."""

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _KernelCacheFile(cache_path=self._cache_path, filename_base=self._impl.filename_base,
                                            source_stamp=self._impl.locator.get_source_stamp())

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except OSError:
            raise
        except Exception as e:  # an entry that unpickles but cannot be rebuilt
            _say_once("damaged", f"a kernel cache entry in {self._cache_path} is damaged ({type(e).__name__}); "
                                 "ignoring it and compiling again")
            return None

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except OSError as e:  # a full or read-only disk under the cache: the kernels still run
            _say_once("unwritable", f"cannot write the kernel cache in {self._cache_path} "
                                    f"({e.strerror or e}); running without caching the kernels compiled now")


def _use_kernel_cache_locator() -> None:
    impl: Any = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")  # _CacheImpl: older numba
    locators = impl._locator_classes
    if _KernelCacheLocator not in locators:
        locators.insert(0, _KernelCacheLocator)


_use_random_function_ids()
_use_kernel_cache_locator()


class _KernelDispatcher(CPUDispatcher):
    """A dispatcher that compiles one specialisation per argument types, whatever constants a caller passes.

    Numba types a constant argument of a call from compiled code as a literal (``Literal[int](0)``) and
    compiles the callee, with every kernel below it, once per distinct constant: ``move_head`` was compiled
    six times, and a third of the planner's compile time went to such copies. Literal arguments are widened
    here before the callee is compiled; code that needs a literal asks for it with ``numba.literally`` or an
    ``@overload``, which this does not touch.
    """

    def enable_caching(self):
        self._cache = _KernelCache(self.py_func)

    def get_call_template(self, args, kws):
        return super().get_call_template(tuple(types.unliteral(a) for a in args),
                                         {k: types.unliteral(v) for k, v in kws.items()})


def njit(func=None, *, cache: bool = True, **options):
    """``numba.njit`` for flashcp kernels: cached (see the module docstring), no literal specialisations."""

    def wrap(py_func):
        if numba.config.DISABLE_JIT:
            return py_func
        dispatcher = _KernelDispatcher(py_func=py_func, locals={}, targetoptions={"nopython": True, **options})
        if cache:
            dispatcher.enable_caching()
        return dispatcher

    return wrap if func is None else wrap(func)


def skip_blas_probe() -> None:
    """Tell numba there is no BLAS before it looks, in the ``flashcp`` command line only.

    The first time numba compiles or loads a kernel it imports its numpy implementations, and one of them
    (``numba.np.arraymath``) imports ``scipy.linalg`` to learn whether ``np.correlate`` may call BLAS:
    0.4-0.5 s of a ``flashcp plan`` start-up (measured on a one-sequence plan, bench/RESULTS.md). flashcp's
    kernels call no BLAS, so the command line (``flashcp.cli.main``) answers that probe with "none": the
    result only picks numba's own loop for ``np.correlate``. Library users' processes are left alone.
    """
    if "numba.np.arraymath" in sys.modules:
        return
    import numba.np.linalg as linalg

    real = linalg.ensure_blas

    def no_blas():
        raise ImportError("flashcp's kernels use no BLAS")

    linalg.ensure_blas = no_blas
    try:
        import numba.np.arraymath  # noqa: F401  (runs the probe, which now finds no BLAS)
    finally:
        linalg.ensure_blas = real


if getattr(sys.modules.get("flashcp"), "COMMAND_LINE", False):
    skip_blas_probe()
