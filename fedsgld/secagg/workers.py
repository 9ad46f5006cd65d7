"""Worker processes for the sites' encodings of an in-process secure round.

An in-process run plays every site in one interpreter, and a site's encoding
(:func:`fedsgld.secagg.ddg.encode`: rotation, randomised rounding, its discrete Gaussian
share) is many numpy calls on 8,192-element blocks with the interpreter lock taken
between them: on the engine's threads the sites' encodings barely run side by side.
:class:`EncodeWorkers` runs them in ``processes`` child interpreters instead
(``python -m fedsgld.secagg.workers``), each answering one encoding at a time, so that
two threads encode on two cores. The vector goes in and the encoding comes out through a
shared memory file per child; its pipes carry the rest and the reply.

What reaches the child is what the site's guard hands to ``encode`` after its charge: the
clipped sum, the round's public parameters and label. The child draws the rounding and
the share from its own operating system randomness (:func:`~fedsgld.secagg.crypto.os_randbytes`,
a fresh key per call, as in the parent) and returns the encoded vector; it keeps nothing
between calls, and no seed or generator state is sent either way. The children belong
to the process that plays the sites (a simulation's one party): they are started with
the pool and stopped by :meth:`EncodeWorkers.close` (their pipes closed, then their own
PIDs), and they exit by themselves when the parent's end of the pipe closes.
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..privacy.distributed import DDGParameters
from .ddg import encode

_READY = "ready"
_STOP_WAIT_S = 10.0  #: how long close() waits for a child to exit before it kills it


def available() -> bool:
    """Whether this system can run encoding workers (shared memory by
    :func:`os.memfd_create`: Linux)."""
    return hasattr(os, "memfd_create")


class WorkerError(RuntimeError):
    """An encoding worker exited or broke its protocol (the round has no contribution)."""


class _Worker:
    """One child interpreter, its two pipes (small messages) and a shared memory file
    (:func:`os.memfd_create`, passed to the child as an inherited descriptor: no name on
    any file system) that carries the vector in and the encoding out."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the fedsgld the parent imported
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"  # one core each
        # large arrays from the heap, kept between calls: no page faults at every array
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
        self.fd = os.memfd_create("fedsgld-encode")
        self.size = 0
        self.shared: mmap.mmap | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fedsgld.secagg.workers", str(self.fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(self.fd,),
                env=env,
                process_group=0,  # its own group: a terminal's Ctrl-C goes to the parent only
            )
        except BaseException:
            os.close(self.fd)
            raise
        self.ready = False

    def _gone(self) -> WorkerError:
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return WorkerError(
            f"encoding worker {self.proc.pid} stopped answering (exit code {code}); its "
            "error, if any, is on this process's stderr"
        )

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        try:
            return pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError) as e:
            raise self._gone() from e

    def _room(self, nbytes: int) -> mmap.mmap:
        """The shared file, grown to at least ``nbytes``."""
        if self.shared is None or nbytes > self.size:
            if self.shared is not None:
                self.shared.close()
            self.size = max(nbytes, 2 * self.size)
            os.ftruncate(self.fd, self.size)
            self.shared = mmap.mmap(self.fd, self.size)
        return self.shared

    def call(
        self, vector: np.ndarray, params: DDGParameters, label: bytes
    ) -> tuple[np.ndarray, float]:
        if not self.ready:
            if self._read() != _READY:
                raise WorkerError(f"encoding worker {self.proc.pid} did not start")
            self.ready = True
        n = vector.shape[0]
        shared = self._room(8 * (n + params.dim))
        np.frombuffer(shared, np.float64, n)[:] = vector
        assert self.proc.stdin is not None
        try:
            pickle.dump((n, params, label, self.size), self.proc.stdin)
            self.proc.stdin.flush()
        except OSError as e:
            raise self._gone() from e
        ok, error, cpu = self._read()
        if not ok:
            raise error  # the child's exception (a bad vector: the same ValueError as here)
        return np.frombuffer(shared, np.uint64, params.dim, 8 * n).copy(), cpu

    def stop(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        try:
            self.proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its PID
            self.proc.wait()
        if self.shared is not None:
            self.shared.close()
        os.close(self.fd)


class EncodeWorkers:
    """``processes`` encoding workers: :meth:`encode` is :func:`fedsgld.secagg.ddg.encode`
    with the operating system's randomness, run in whichever worker is free (threads
    calling it at once use different workers). ``cpu_seconds``: the workers' CPU time
    spent encoding so far (not in this process's :func:`time.process_time`);
    ``encodings``: how many they returned. Use as a
    context manager, or call :meth:`close`."""

    def __init__(self, processes: int) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
        if not available():
            raise ValueError("encoding workers need os.memfd_create (Linux): set "
                             "secagg_encoders = threads on this system")  # fmt: skip
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        try:
            for _ in range(processes):
                self._workers.append(_Worker())
        except BaseException:
            for w in self._workers:  # the ones already started
                w.stop()
            raise
        for w in self._workers:
            self._idle.put(w)
        self._lock = threading.Lock()
        self.cpu_seconds = 0.0
        self.encodings = 0
        self.closed = False

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def encode(self, vector: np.ndarray, params: DDGParameters, label: bytes) -> np.ndarray:
        """One site's encoded contribution (uint64, length ``params.dim``), drawn in a worker."""
        if self.closed:
            raise WorkerError("the encoding workers are closed")
        worker = self._idle.get()
        try:
            out, cpu = worker.call(np.asarray(vector, dtype=np.float64).ravel(), params,
                                   bytes(label))  # fmt: skip
        finally:
            self._idle.put(worker)
        with self._lock:
            self.cpu_seconds += cpu
            self.encodings += 1
        return out

    def close(self) -> None:
        """Stop every worker (idempotent): its input closed, then its PID killed if it has
        not exited within ``_STOP_WAIT_S`` seconds."""
        if not self.closed:
            self.closed = True
            for w in self._workers:
                w.stop()

    def __enter__(self) -> EncodeWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(fd: int, requests: IO[bytes], replies: IO[bytes]) -> None:
    """The worker's loop: (length, params, label, shared size) in, the vector read from
    and its encoding written to the shared file, (ok, error, cpu seconds) out, until its
    input closes."""
    pickle.dump(_READY, replies)
    replies.flush()
    shared, size = None, 0
    while True:
        try:
            n, params, label, new_size = pickle.load(requests)
        except EOFError:
            return
        start = time.process_time()
        if new_size != size:
            if shared is not None:
                shared.close()
            shared, size = mmap.mmap(fd, new_size), new_size
        try:
            vector = np.frombuffer(shared, np.float64, n).copy()
            out = encode(vector, params, label)
            np.frombuffer(shared, np.uint64, params.dim, 8 * n)[:] = out
            reply = (True, None, time.process_time() - start)
        except Exception as e:  # noqa: BLE001 - handed to the caller, raised there
            reply = (False, e, 0.0)
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    # an interrupt is the parent's to handle (it closes the pipes, and the loop ends there)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _replies = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the replies
    _serve(int(sys.argv[1]), sys.stdin.buffer, _replies)
