"""Builds the CPU kernels' C++ extension (hybridjax/cpu_kernels/matmul.cc); metadata is in
pyproject.toml. The XLA FFI headers come from the installed jaxlib (`jax.ffi.include_dir()`),
so jax must be importable while building (a build requirement in pyproject.toml).

The extension is optional: if it fails to build, the install still succeeds and the model runs
on XLA's dots (hybridjax.cpu_kernels logs why once); its tests then fail, so CI notices.
"""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class BuildWithJaxHeaders(build_ext):
    def build_extensions(self):
        import jax.ffi  # only now: a plain `setup.py --version` needs no jax

        for ext in self.extensions:  # -isystem: the headers' own warnings are not ours
            ext.extra_compile_args += ["-isystem", jax.ffi.include_dir()]
        super().build_extensions()


# A plain shared library that Python loads with ctypes (no Python C API inside). No -march:
# the kernel picks AVX-512 / AVX2 code at run time from cpuid, so one build runs on any x86-64.
matmul = Extension(
    "hybridjax.cpu_kernels._matmul",
    sources=["hybridjax/cpu_kernels/matmul.cc"],
    language="c++",
    # GCC 12 flags its own _mm512_undefined_* intrinsics as uninitialized at -O3. -g0: Python's
    # own flags ask for debug info, which took a third of the build (36 s against 24 s) and 4.9 MB.
    extra_compile_args=["-std=c++17", "-O3", "-g0", "-fvisibility=hidden", "-Wno-uninitialized",
                        "-Wno-maybe-uninitialized"],
    optional=True,
)

# The kernels and the converter sit at the repository root, where the project's layout draws them,
# and install under the package's namespace (hybridjax.pallas_kernels, hybridjax.conversion), so no
# generic top-level import name is installed. Editable installs map them the same way.
ROOT_SUBPACKAGES = ("pallas_kernels", "conversion")
packages = find_packages(include=["hybridjax", "hybridjax.*"]) + [
    "hybridjax." + name for name in find_packages(include=[f"{p}{s}" for p in ROOT_SUBPACKAGES for s in ("", ".*")])
]
# The embedded default model's files sit in a directory without __init__.py: listed as a package
# of its own (its files as its package data, pyproject.toml), which is what setuptools wants of an
# importable directory it installs (else a screenful of "Package would be ignored" in every install).
packages += ["hybridjax.default_model.weights"]
package_dir = {"hybridjax." + name: name for name in ROOT_SUBPACKAGES}

setup(packages=packages, package_dir=package_dir, ext_modules=[matmul],
      cmdclass={"build_ext": BuildWithJaxHeaders})
