"""Builds verispec's native block kernel (verispec/blockmm/_native.cpp) when verispec is installed.

Everything else is declared in pyproject.toml. The kernel is optional: where it does not compile (no C++ compiler,
another platform) the install goes on without it and the engines that need it say so (``verispec models``).
Instruction sets are chosen at run time, so the build is the same on every x86-64 CPU (no -march=native).
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Where the kernel fails to build (it is optional), deletes the one an earlier build left in the source tree:
    it would otherwise still import, with the old code."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception:
            for stale in (Path(__file__).parent / "verispec" / "blockmm").glob("_native*.so"):
                stale.unlink()
            raise


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[Extension(
    "verispec.blockmm._native",
    sources=["verispec/blockmm/_native.cpp"],
    depends=["verispec/blockmm/simd_body.inc", "verispec/blockmm/attend_body.inc", "verispec/blockmm/amx_body.inc"],
    language="c++",
    # -ffp-contract=off: no fused multiply-add, so every path (scalar, AVX2, VNNI) rounds as the reference does;
    # -g0: no debug information (Python's own flags ask for it): the same code, built in two thirds of the time
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
                        "-pthread", "-g0"],
    extra_link_args=["-pthread"],
    optional=True,
)])
