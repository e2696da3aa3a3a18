"""The install step that pyproject.toml cannot say: compile ember's C++ CPU kernels for this machine.

After setuptools has copied the package, `python -m ember.kernels.cpp_build --all` builds every
kernel this CPU can run into ember/kernels/_prebuilt/ (the source tree for an editable install,
the wheel otherwise), so no engine compiles at start. It needs torch in the build environment:
install with `pip install --no-build-isolation` after torch (as `make` does). Without torch there,
or without a compiler, the install still succeeds and says so; each kernel is then built once on
first use (ember.kernels.cpp_build), or its torch path runs.
"""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        try:
            import torch  # noqa: F401
        except ImportError:
            print(
                "ember: torch is not in the build environment, so the C++ kernels were not built now; each is "
                "built once on first use (install with --no-build-isolation after torch to build them here)"
            )
            return
        editable = getattr(self, "editable_mode", False)
        out = os.path.join(ROOT if editable else self.build_lib, "ember", "kernels", "_prebuilt")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        print(f"ember: building the C++ CPU kernels for this machine into {out}", flush=True)
        subprocess.run([sys.executable, "-m", "ember.kernels.cpp_build", "--all", "--out", out], env=env, check=False)


setup(cmdclass={"build_py": BuildPyWithKernels})
