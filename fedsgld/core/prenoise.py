"""DP-SGLD's pre-noise rho z_i, one row per record, drawn while the gradients are computed.

A chunk of B records needs B x P standard normals (z_i ~ N(0, I_P) independent per record
and parameter), about as many random numbers as the step has multiply-adds on a small
network. A torch CPU generator is one Mersenne Twister stream, drawn on one core, so on the
CPU a chunk's draw (:func:`prenoise_values`) is split over ``SUBSTREAMS`` = 8 sub-streams,
each a contiguous block of the chunk's values, drawn on up to 8 threads:

* the sub-streams are derived from the party's generator, at the party: 248 bits drawn from
  it (one key per chunk, so every chunk and step has fresh streams and no noise is reused),
  expanded by SHAKE-256 with the sub-stream's index into a whole Mersenne Twister state
  (624 x 32 bits). Nothing of it leaves the party; a deployment's generator is seeded from
  the operating system, and so are its sub-streams;
* the number of sub-streams is fixed, so a seed gives the same numbers whatever the thread
  count (1 thread draws the 8 blocks in turn);
* each value is exactly a float32 N(0, rho^2) draw of torch's sampler, from a stream no
  other value of the chunk uses (tests/core/test_prenoise_streams.py: Kolmogorov-Smirnov
  per block, correlation across records and sub-streams).

When torch may use n > 1 threads, the chunk's noise is drawn beside the gradients: on
``draw_threads()`` = max(1, n // 2) threads while the calling thread computes the gradients
with the rest (:func:`sharing_threads`: the step never runs more busy threads than torch
is allowed), and the two meet before clipping, which uses all n threads again.

The party's generator is used by one thread at a time (the caller waits for the draw
before touching it again), in a fixed order: a seed gives the same numbers whether the draw
runs in the background or not. On a GPU the draw is one ``gaussian_noise`` queued on the
device like any other kernel (no sub-streams, no thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from fedsgld.core.noise import MT19937_WORDS, cpu_generator_from_bytes, gaussian_noise

SUBSTREAMS = 8  # sub-streams of one chunk's pre-noise (fixed: a seed's numbers never depend
# on the thread count)
_KEY_DRAWS = 4  # values of 62 bits drawn from the party's generator: a 248-bit key per chunk
_DOMAIN = b"fedsgld/prenoise-substream/v1"


def substreams(generator: torch.Generator, count: int = SUBSTREAMS) -> list[torch.Generator]:
    """``count`` CPU generators for one draw, derived from the party's ``generator``:
    a 248-bit key drawn from it, each sub-stream's whole Mersenne Twister state
    SHAKE-256(domain, key, index). Advances ``generator`` by the key's draw."""
    key = torch.randint(0, 2**62, (_KEY_DRAWS,), generator=generator, dtype=torch.int64)
    key_bytes = b"".join(int(k).to_bytes(8, "little") for k in key.tolist())
    out = []
    for j in range(count):
        h = hashlib.shake_256(_DOMAIN + key_bytes + j.to_bytes(4, "little"))
        out.append(cpu_generator_from_bytes(h.digest(4 * MT19937_WORDS)))
    return out


def draw_threads() -> int:
    """Threads a pre-noise draw may use: half of torch's (the gradients get the rest)."""
    return max(1, torch.get_num_threads() // 2)


def prenoise_values(
    n: int, *, std: float, generator: torch.Generator, threads: int = 1
) -> torch.Tensor:
    """n values of N(0, std^2), float32, on the generator's device: on the CPU the
    ``SUBSTREAMS`` contiguous blocks of the module docs (numbers independent of
    ``threads``, which only says how many draw at once); on a GPU one draw."""
    if generator.device.type != "cpu" or std == 0.0:
        return gaussian_noise((n,), std=std, generator=generator)
    if not (std > 0.0 and std < float("inf")):
        raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
    gens = substreams(generator)
    out = torch.empty(n, dtype=torch.float32)
    edges = [n * j // SUBSTREAMS for j in range(SUBSTREAMS + 1)]

    def block(j: int) -> None:
        if edges[j + 1] > edges[j]:
            out[edges[j] : edges[j + 1]].normal_(0.0, std, generator=gens[j])

    workers = max(1, min(int(threads), SUBSTREAMS))
    if workers == 1:
        for j in range(SUBSTREAMS):
            block(j)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedsgld-prenoise") as ex:
            list(ex.map(block, range(SUBSTREAMS)))  # re-raises a block's error
    return out


def draw_in_background(generator: torch.Generator) -> bool:
    """Whether pre-noise is drawn on a second thread: CPU generators, when torch may use
    more than one thread (``threads=1`` keeps the whole step on one core)."""
    return generator.device.type == "cpu" and torch.get_num_threads() > 1


class PrenoiseRows:
    """rho * z for ``rows`` records of ``cols`` numbers each, drawn at construction.

    The draw is one flat vector of rows * cols normals (:func:`prenoise_values`), which
    :func:`fedsgld.core.clipping.param_blocks` lays out parameter by parameter: block j,
    a contiguous (rows, numel_j) view, holds the pre-noise of parameter j for every record.
    ``result()`` waits for the draw and returns the flat vector (a fresh float32 tensor on
    the generator's device, the caller's to modify); ``wait()`` only waits. A failed draw
    re-raises its exception in ``result()``. ``then`` is called once the draw is done and
    taken (by ``result()``): it starts the next chunk's draw while this chunk is clipped,
    after this draw has finished with the generator.
    """

    def __init__(
        self,
        rows: int,
        cols: int,
        *,
        std: float,
        generator: torch.Generator,
        background: bool | None = None,
        then: Callable[[], object] | None = None,
    ) -> None:
        if not isinstance(generator, torch.Generator):
            raise ValueError("pre-noise needs an explicit torch.Generator (generator=...)")
        self._shape = (int(rows) * int(cols),)
        self._std = float(std)
        self._generator = generator
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._then = then
        if background is None:
            background = draw_in_background(generator)
        self._background = bool(background)
        self._threads = draw_threads() if background else 1  # decided here, not in the thread
        if background:
            self._thread = threading.Thread(target=self._draw, name="fedsgld-prenoise")
            self._thread.start()
        else:
            self._draw()

    def _draw(self) -> None:
        try:
            self._value = prenoise_values(
                self._shape[0],
                std=self._std,
                generator=self._generator,
                threads=self._threads,
            )
        except BaseException as err:  # handed to the caller by result()
            self._error = err

    @property
    def in_background(self) -> bool:
        """Whether the draw was started on another thread (finished or not: what runs
        beside it must not depend on a race, or float sums would change run to run)."""
        return self._background

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def result(self) -> torch.Tensor:
        self.wait()
        if self._error is not None:
            raise self._error
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("pre-noise rows were already taken")
        then, self._then = self._then, None
        if then is not None:
            then()
        return value


@contextlib.contextmanager
def sharing_threads(noise: PrenoiseRows | None) -> Iterator[None]:
    """Run the block with ``draw_threads()`` torch threads fewer while ``noise`` is drawn on
    other threads, so that the draw and the computation share the threads torch may use."""
    if noise is None or not noise.in_background:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(max(1, n - draw_threads()))
    try:
        yield
    finally:
        torch.set_num_threads(n)
