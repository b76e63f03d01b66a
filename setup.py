"""Build of lmcache-fx: one C extension, lmcache_fx._fxio.

liburing is linked statically when its header and static library are found
(Debian/Ubuntu: liburing-dev), so the installed module needs no liburing at
run time; where only its shared library is installed (Fedora/RHEL:
liburing-devel), it is linked to that. Without it the build still succeeds
with the thread engine only, and says so. LMCACHE_FX_NO_URING=1 forces that
build; LIBURING_PREFIX points at a liburing installed elsewhere.
"""

import glob
import os
import sys

from setuptools import Extension, setup


def find_liburing():
    if os.environ.get("LMCACHE_FX_NO_URING") == "1":
        return None, "LMCACHE_FX_NO_URING=1"
    prefixes = [os.environ.get("LIBURING_PREFIX", ""), "/usr", "/usr/local"]
    why = ""
    for prefix in filter(None, prefixes):
        header = os.path.join(prefix, "include", "liburing.h")
        if not os.path.exists(header):
            continue
        for lib in ("liburing.a", "liburing.so"):  # static first: nothing to install at run time
            libs = glob.glob(os.path.join(prefix, "lib*", lib)) + glob.glob(
                os.path.join(prefix, "lib*", "*-linux-gnu*", lib)
            )
            if libs:
                return (os.path.join(prefix, "include"), libs[0]), None
        why = f"{header} found but no liburing.a or liburing.so next to it"
    if why:
        return None, why
    return None, (
        "liburing.h not found (Debian/Ubuntu: apt-get install liburing-dev; Fedora/RHEL: dnf install liburing-devel)"
    )


uring, why_not = find_liburing()
define_macros = []
include_dirs = ["csrc"]
extra_objects = []
libraries = ["pthread", "dl"]
library_dirs = []
runtime_library_dirs = []
if uring:
    define_macros.append(("FX_HAVE_LIBURING", "1"))
    include_dirs.append(uring[0])
    if uring[1].endswith(".a"):
        extra_objects.append(uring[1])
    else:  # linked to the shared library: liburing must be installed where the module runs
        libraries.append("uring")
        library_dirs.append(os.path.dirname(uring[1]))
        if not os.path.dirname(uring[1]).startswith(("/usr/lib", "/lib")):  # where the loader does not look
            runtime_library_dirs.append(os.path.dirname(uring[1]))
else:
    sys.stderr.write(f"lmcache-fx: building WITHOUT io_uring: {why_not}. Only the thread engine will be available.\n")

setup(
    ext_modules=[
        Extension(
            "lmcache_fx._fxio",
            sources=sorted(glob.glob("csrc/*.c")),
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_objects=extra_objects,
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                "-Wno-cast-function-type",
            ],
            libraries=libraries,
            library_dirs=library_dirs,
            runtime_library_dirs=runtime_library_dirs,
        )
    ],
)
