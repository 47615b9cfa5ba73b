"""The scheduler's core compiled with mypyc: `python -m luftpause.native`.

`make up` and `make test` run it whenever the core's sources change (`make core` by
hand).  The core (`scheduler/_core.py`, `scheduler/_persistent.py`) is plain, fully
typed Python; mypyc, which ships with mypy, compiles it to C extension modules in
`build/native/scheduler/` (`_core.cpython-311-x86_64-linux-gnu.so`, ...), and
`scheduler/__init__.py` puts that directory first on the package's `__path__`, so
`import scheduler._core` takes the extension.  The build stays out of `scheduler/`: a
checkout of a revision from before it (`git bisect`) does not look there and runs its
own sources.  The decisions are the same (tests check it); `luftpause sim bench-core`
makes about 1.9x as many per second (bench/RESULTS.md).  The pattern of black's and
mypy's own wheels, built in the checkout.

Compiled, the core holds to its annotations at run time: an int passed where a float is
declared becomes a float, a float where an int is declared is a TypeError, and its
records are read-only (and cannot be copied or pickled).  The gateway and the simulator
pass what the annotations say.

Without a C compiler (and Python's headers) the build fails, says so, and leaves no
extension behind: the core then runs interpreted.  An extension older than a source of
the core would run old code, so `core_build()` reports it, the test suite stops on it,
and the gateway logs it.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What is compiled; `scheduler/_types.py` stays interpreted (its events and actions are
# built by the shells, and compiling it measured no faster), but the compiled core is
# built against its declarations, so a change to it makes the build stale too.
SOURCES = ("scheduler/_core.py", "scheduler/_persistent.py")
DEPENDS = (*SOURCES, "scheduler/_types.py")
NATIVE = "build/native"  # the build's root: its modules in build/native/scheduler/
GROUP = "scheduler._mypyc"  # the shared runtime module, kept inside the package
_RUNTIME = GROUP.rpartition(".")[2]  # its file's name starts so: it has no source
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _compiled_in(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{_SUFFIX}"))


def extensions(root: Path = ROOT) -> list[Path]:
    """The compiled modules of the checkout (or copy) at `root`: the build's, and any
    built in place beside the sources (bench.core_compare's copies)."""
    return _compiled_in(root / NATIVE / "scheduler") + _compiled_in(root / "scheduler")


def stale(root: Path = ROOT) -> list[str]:
    """The core's sources that changed after `make` built it into build/native (or that
    are gone while an extension of them is there): the extensions would run old code.
    (Extensions beside the sources come with them, from a wheel or bench.core_compare.)"""
    built = _compiled_in(root / NATIVE / "scheduler")
    if not built:
        return []
    oldest = min(ext.stat().st_mtime for ext in built)
    found: list[str] = []
    for name in DEPENDS:
        path = root / name
        if path.exists() and path.stat().st_mtime > oldest:
            found.append(name)
    for ext in built:
        name = f"scheduler/{ext.name.removesuffix(_SUFFIX)}.py"
        if not ext.name.startswith(_RUNTIME) and not (root / name).exists():
            found.append(name)
    return sorted(set(found))


def core_build() -> str:
    """How the scheduler's core runs in this process: "compiled" (mypyc),
    "compiled, stale" (older than a source: `make core` rebuilds it), or
    "interpreted"."""
    import scheduler._core

    where = Path(scheduler._core.__file__ or "")
    if not where.name.endswith(_SUFFIX):
        return "interpreted"
    if not where.parent.parent.as_posix().endswith(NATIVE):
        return "compiled"  # beside its sources: a wheel's, or bench.core_compare's copy
    return "compiled, stale" if stale(where.parents[3]) else "compiled"


def remove(root: Path = ROOT) -> None:
    for ext in extensions(root):
        ext.unlink()


def build(root: Path = ROOT, *, inplace: bool = False) -> None:
    """Compile the core of the checkout (or copy of `scheduler/`) at `root` into
    `root/build/native`, or beside its sources (`inplace`: a revision from before the
    package looked in build/native).  Raises if mypyc or the C compiler fails; then no
    extension is left."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    remove(root)  # an old extension never outlives a failed build
    # The extensions are stamped with this time, not the build's end: a source saved
    # while the compiler runs is newer than them, hence stale.
    began = time.time()
    cwd = Path.cwd()
    os.chdir(root)  # mypycify takes paths relative to the project
    try:
        modules = mypycify(list(SOURCES), group_name=GROUP, target_dir="build/mypyc")
        # A bare Distribution: nothing of pyproject.toml is read (only the extensions).
        options = {
            "inplace": inplace,
            "build_temp": "build/mypyc/temp",
            "build_lib": NATIVE,
        }
        dist = Distribution(
            {"name": "luftpause-core", "ext_modules": modules, "options": {"build_ext": options}}
        )
        dist.verbose = False
        dist.run_command("build_ext")
        for ext in extensions(root):
            # An unchanged module may have been copied from an earlier build with that
            # build's time.
            os.utime(ext, (began, began))
    except BaseException:
        remove(root)
        raise
    finally:
        os.chdir(cwd)


def main() -> int:
    try:
        build()
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error; it has said why
        print(
            f"luftpause: the scheduler's core was not compiled ({type(exc).__name__}: {exc}); "
            "it runs interpreted (the same decisions, slower)",
            file=sys.stderr,
        )
        return 1
    names = ", ".join(p.relative_to(ROOT).as_posix() for p in extensions())
    print(f"luftpause: compiled the scheduler's core with mypyc: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
