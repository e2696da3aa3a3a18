"""One benchmark side in a process of its own, so its peak memory is its own.

`ember bench compare | matrix` start `python -m ember.bench.sides.worker` once per side; the worker
builds the side (local.build) and answers measurement calls over its stdin/stdout, pickled, one
call at a time. Everything else the side prints (llama.cpp's C code writes to fd 1) is moved to
stderr, so it cannot corrupt the replies.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys

from ember.bench.sides.local import LocalSide, build, peak_rss_bytes
from ember.errors import ConfigError, EmberError


def worker_module(checkout: str | None = None) -> str:
    """This module's name in this ember, or in the ember of another checkout (one from before bench/sides/
    has the worker at ember.bench.worker: a baseline is often an earlier commit)."""
    if checkout is None or os.path.exists(os.path.join(checkout, "ember", "bench", "sides", "worker.py")):
        return "ember.bench.sides.worker"
    return "ember.bench.worker"


class RemoteSide:
    shared_process = False

    def __init__(self, factory: str, kwargs: dict, threads: int, pythonpath: str | None = None):
        """pythonpath: a source tree the worker imports ember from instead of this one (another
        checkout, measured as a baseline)."""
        # the thread count is fixed before torch or llama.cpp starts its pools
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        # -P: `python -m` would put the current directory first on sys.path, and a driver run from a
        # checkout's root would measure that checkout's ember as the "baseline"
        isolate = ["-P"] if pythonpath is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, *isolate, "-m", worker_module(pythonpath)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.pid = self.proc.pid
        info = self._call("build", factory, kwargs, threads)
        self.description, self.weight_bytes, self.prompt_vocab = info

    def _call(self, method: str, *args):
        try:
            pickle.dump((method, args), self.proc.stdin)
            self.proc.stdin.flush()
            reply = pickle.load(self.proc.stdout)
        except (BrokenPipeError, EOFError):
            raise RuntimeError(
                f"benchmark worker died during {method} (exit code {self.proc.wait()}); its stderr above says why"
            ) from None
        if reply[0] == "ok":
            return reply[1]
        _, user_error, message = reply
        self.close()
        raise (ConfigError if user_error else RuntimeError)(message)

    def decode(self, prompt, n):
        return self._call("decode", prompt, n)

    def ttft(self, prompt):
        return self._call("ttft", prompt)

    def batch(self, prompts, output_len, *more):
        return self._call("batch", prompts, output_len, *more)

    def call(self, method: str, *args):
        """Any other method of the side (e.g. EmberSide.op_split), in its process."""
        return self._call(method, *args)

    def peak_rss_bytes(self) -> int:
        return self._call("peak_rss_bytes")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the worker returns
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_side(factory: str, kwargs: dict, threads: int, in_process: bool, pythonpath: str | None = None):
    """The side built by `factory`, here (in_process) or in a worker process of its own."""
    return LocalSide(factory, kwargs) if in_process else RemoteSide(factory, kwargs, threads, pythonpath)


def _answer(side, method: str, args: tuple):
    if method == "build":
        factory, kwargs, threads = args
        try:
            import torch

            torch.set_num_threads(threads)
        except ImportError:
            pass
        side = build(factory, kwargs)
        return side, (side.description, getattr(side, "weight_bytes", None), getattr(side, "prompt_vocab", None))
    if method == "peak_rss_bytes":
        return side, peak_rss_bytes()
    return side, getattr(side, method)(*args)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    side = None
    while True:
        try:
            method, args = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            side, value = _answer(side, method, args)
            reply = ("ok", value)
        except Exception as e:  # sent back to the driver, which raises it there
            reply = (
                "error",
                isinstance(e, EmberError),
                f"{type(e).__name__}: {e}" if not isinstance(e, EmberError) else str(e),
            )
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    main()
