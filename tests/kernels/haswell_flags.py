"""A pytest plugin for a child run of a kernel test module against the AVX2 build on an AVX-512
machine (`-p tests.kernels.haswell_flags`): ember reads this machine's CPU flags without the
AVX-512 ones, as a Haswell or Zen3 machine's, so its Python side takes the paths that build
serves (float32 x, no int8-x path). The build's name hashes the flags line, which is
left as it is: the child finds the -march=haswell build its parent put in EMBER_KERNEL_DIR."""

import ember.platform as platform

_FLAGS = frozenset(f for f in platform.cpu_flags() if not f.startswith("avx512"))
platform.cpu_flags = lambda: _FLAGS
