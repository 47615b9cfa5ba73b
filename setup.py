"""setuptools' one dynamic part: a wheel whose scheduler core is compiled with mypyc.

`pip wheel --no-build-isolation .` where mypy is installed (deploy/Dockerfile's build
stage) builds the core (luftpause/native.py's SOURCES) into the wheel as C extensions
beside their sources, as black's and mypy's own wheels are.  Everywhere else the wheel
is plain Python: in pip's default isolated build (no mypy there), for an editable
install (`make`'s .venv compiles into build/native instead, out of the package), and
when the C compiler fails, which this reports; the core then runs interpreted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

# setuptools' build backend runs this file without the project on sys.path; what is
# compiled is luftpause/native.py's to say (it imports only the standard library).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from luftpause.native import GROUP, SOURCES


class _OptionalBuildExt(build_ext):
    """A failed compile leaves a plain wheel, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            for path in self.get_outputs():
                Path(path).unlink(missing_ok=True)
            self.extensions = []
            print(
                f"luftpause: the scheduler's core was not compiled ({exc}); "
                "the wheel's core runs interpreted",
                file=sys.stderr,
            )


def _compiled() -> list[Any]:
    if "editable_wheel" in sys.argv:
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    return list(mypycify(list(SOURCES), group_name=GROUP))


setup(ext_modules=_compiled(), cmdclass={"build_ext": _OptionalBuildExt})
