"""The sites' encodings in child processes (fedsgld.secagg.workers): the same mechanism as
an encoding in the calling thread, fresh noise in every call, clear errors, and no child
left behind."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedsgld.config import Config
from fedsgld.secagg.ddg import centre, decode, to_modular
from fedsgld.secagg.workers import EncodeWorkers, WorkerError

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy"))
from test_secagg import CLIP, SIGMA, params  # noqa: E402  (the primitives' mechanism)

DIM = 32_768


@pytest.fixture(scope="module")
def workers():
    with EncodeWorkers(2) as pool:
        yield pool


def test_the_sum_of_worker_encodings_carries_the_central_noise(workers):
    """Four sites' zero vectors encoded by two workers, called from two threads at once:
    the decoded sum is the central mechanism's N(0, sigma^2 C^2) (variance within 5 of its
    standard errors; a KS test that rejects 2/3 and 3/2 of the scale)."""
    p = params(4, DIM)
    out: dict[int, np.ndarray] = {}

    def site(i: int) -> None:
        out[i] = workers.encode(np.zeros(DIM), p, b"workers noise")

    for pair in ((0, 1), (2, 3)):
        threads = [threading.Thread(target=site, args=(i,)) for i in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    total = to_modular(sum(out[i].view(np.int64) for i in range(4)), p.bits)
    noise = decode(total, p, b"workers noise", DIM)
    target = SIGMA * CLIP
    assert abs(noise.var() / target**2 - 1.0) < 5 * math.sqrt(2.0 / DIM)
    assert stats.kstest(noise / target, "norm").pvalue > 1e-5
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(noise / (wrong * target), "norm").pvalue < 1e-6
    assert workers.cpu_seconds > 0.0


def test_every_worker_encoding_draws_a_fresh_share(workers):
    """Four encodings of one vector in one round, two in each worker (calls one after the
    other alternate between the free workers): every pair differs by two independent
    shares, variance 2 s^2 per coordinate (0 if a worker replayed its own or the other's
    randomness), and the vector itself decodes back within the noise."""
    p = params(4, 8192)
    x = np.random.default_rng(2).normal(0.0, 1.0, 8192)
    encoded = [workers.encode(x, p, b"same round").view(np.int64) for _ in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            diff = centre(to_modular(encoded[i] - encoded[j], p.bits), p.bits).astype(float)
            assert abs(diff.var() / (2 * p.share_variance) - 1.0) < 0.1
    back = decode(to_modular(encoded[0], p.bits), p, b"same round", 8192)
    share_std = math.sqrt(p.share_variance) * p.gamma
    assert np.abs(back - x).max() < 8 * share_std + p.gamma * math.sqrt(8192)


def test_an_encoding_error_is_raised_in_the_caller_and_the_workers_go_on(workers):
    p = params(4, 1024)
    with pytest.raises(ValueError, match="vector must be finite"):
        workers.encode(np.full(1024, np.nan), p, b"bad")
    with pytest.raises(ValueError, match="at most 1024 entries"):
        workers.encode(np.zeros(2048), p, b"bad")
    assert workers.encode(np.zeros(1024), p, b"good").shape == (1024,)


def test_an_interrupt_is_left_to_the_parent(workers):
    """The children run in their own process group (a terminal's Ctrl-C reaches the
    parent only) and ignore an interrupt sent to them: they go on answering, and the
    parent stops them by closing their pipes."""
    p = params(4, 1024)
    for _ in workers.pids:  # both started (calls alternate between free workers)
        workers.encode(np.zeros(1024), p, b"before ^C")
    for pid in workers.pids:
        assert os.getpgid(pid) == pid != os.getpgid(0)
        os.kill(pid, signal.SIGINT)
    for _ in workers.pids:
        assert workers.encode(np.zeros(1024), p, b"after ^C").shape == (1024,)
    assert all(w.proc.poll() is None for w in workers._workers)


def test_a_dead_worker_is_a_clear_error_and_close_stops_every_child():
    pool = EncodeWorkers(2)
    p = params(4, 1024)
    pool.encode(np.zeros(1024), p, b"up")  # the first worker answers
    first, second = pool.pids
    os.kill(first, signal.SIGKILL)  # our own child, by its PID
    pool.encode(np.zeros(1024), p, b"up")  # the queue's next worker: the second
    with pytest.raises(WorkerError, match=f"worker {first} stopped answering"):
        pool.encode(np.zeros(1024), p, b"dead")
    pool.close()
    assert all(w.proc.poll() is not None for w in pool._workers)
    with pytest.raises(WorkerError, match="closed"):
        pool.encode(np.zeros(1024), p, b"after")
    pool.close()  # idempotent
    assert second in pool.pids


def test_processes_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="processes must be an integer >= 1"):
            EncodeWorkers(bad)


def test_the_setting_chooses_the_encoders():
    perf = Config.from_flat({}).perf
    assert perf.secagg_encoders == "auto"
    assert perf.encode_processes(16, 2) == 2 and perf.encode_processes(8, 4) == 4
    assert perf.encode_processes(4, 2) == 0 and perf.encode_processes(16, 1) == 0
    procs = Config.from_flat({"secagg_encoders": "processes"}).perf
    assert procs.encode_processes(2, 1) == 1 and procs.encode_processes(4, 2) == 2
    assert Config.from_flat({"secagg_encoders": "threads"}).perf.encode_processes(64, 8) == 0
    with pytest.raises(ValueError, match="secagg_encoders must be one of"):
        Config.from_flat({"secagg_encoders": "gpu"})
