"""The scheduler's core compiled with mypyc, in place: `python -m luftpause.native`.

`make up` and `make test` run it whenever the core's sources change (`make core` by
hand).  The core (`scheduler/_core.py`, `scheduler/_persistent.py`) is plain, fully
typed Python; mypyc, which ships with mypy, compiles it to C extension modules written
beside their sources (`scheduler/_core.cpython-311-x86_64-linux-gnu.so`, ...), where
Python's import takes them before the `.py`.  The decisions are the same (tests check
it); `luftpause sim bench-core` makes about 1.9x as many per second (bench/RESULTS.md).
The same pattern as black's and mypy's own wheels, but built in the checkout.

Without a C compiler the build fails, says so, and leaves no extension behind: the
core then runs interpreted.  An extension older than its source would run the old
code, so `core_build()` reports it, the test suite stops on it, and the servers log it.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What is compiled; `scheduler/_types.py` stays interpreted (its events and actions are
# built by the shells, and compiling it measured no faster).
SOURCES = ("scheduler/_core.py", "scheduler/_persistent.py")
GROUP = "scheduler._mypyc"  # the shared runtime module, kept inside the package
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def extensions(root: Path = ROOT) -> list[Path]:
    """The compiled modules present in the checkout."""
    return sorted((root / "scheduler").glob(f"*{_SUFFIX}"))


def stale(root: Path = ROOT) -> list[str]:
    """The core's sources changed after their extension was built (or an extension has
    no source any more): the extension would run old code."""
    found = []
    for ext in extensions(root):
        if ext.name.startswith(GROUP.split(".")[1]):
            continue  # the shared runtime: the modules' own checks cover it
        source = ext.with_name(ext.name.removesuffix(_SUFFIX) + ".py")
        if not source.exists() or source.stat().st_mtime > ext.stat().st_mtime:
            found.append(source.relative_to(root).as_posix())
    return found


def core_build() -> str:
    """How the scheduler's core runs in this process: "compiled" (mypyc),
    "compiled, stale" (older than its source: `make core` rebuilds it), or
    "interpreted"."""
    import scheduler._core

    where = scheduler._core.__file__ or ""
    if not where.endswith(_SUFFIX):
        return "interpreted"
    return "compiled, stale" if stale(Path(where).parent.parent) else "compiled"


def remove(root: Path = ROOT) -> None:
    for ext in extensions(root):
        ext.unlink()


def build(root: Path = ROOT) -> None:
    """Compile the core in place (in `root`, a checkout or a copy of its `scheduler/`);
    raises if mypyc or the C compiler fails (then no extension is left)."""
    import os

    from mypyc.build import mypycify
    from setuptools import Distribution

    remove(root)  # an old extension never outlives a failed build
    cwd = Path.cwd()
    os.chdir(root)  # mypycify takes paths relative to the project
    try:
        modules = mypycify(list(SOURCES), group_name=GROUP, target_dir="build/mypyc")
        # A bare Distribution: nothing of pyproject.toml is read (only the extensions).
        options = {
            "inplace": True,
            "build_temp": "build/mypyc/temp",
            "build_lib": "build/mypyc/lib",
        }
        dist = Distribution(
            {"name": "luftpause-core", "ext_modules": modules, "options": {"build_ext": options}}
        )
        dist.verbose = False
        dist.run_command("build_ext")
        for ext in extensions(root):
            # Built from the sources as they are now; an unchanged module was copied
            # from an earlier build with that build's time, which `stale()` would read
            # as older than a source touched since (a checkout, a stash).
            os.utime(ext)
    except BaseException:
        remove(root)
        raise
    finally:
        os.chdir(cwd)


def main() -> int:
    try:
        build()
    except Exception as exc:  # the compiler's own output has said what went wrong
        print(
            f"luftpause: the scheduler's core was not compiled ({type(exc).__name__}: {exc}); "
            "it runs interpreted (the same decisions, slower)",
            file=sys.stderr,
        )
        return 1
    names = ", ".join(p.name for p in extensions())
    print(f"luftpause: compiled the scheduler's core with mypyc: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
