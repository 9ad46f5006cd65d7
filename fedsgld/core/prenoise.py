"""DP-SGLD's pre-noise rho z_i, one row per record, drawn while the gradients are computed.

A chunk of B records needs B x P standard normals (z_i ~ N(0, I_P) independent per record
and parameter), about as many random numbers as the step has multiply-adds on a small
network. On the CPU, torch draws them with one Mersenne Twister stream, on one core,
whatever the thread count. So when torch may use n > 1 threads, the chunk's noise is drawn
on a second thread while the calling thread computes the gradients with n - 1 threads
(:func:`sharing_threads`: the step never runs more busy threads than torch is allowed),
and the two meet before clipping, which uses all n threads again.

The generator is the caller's explicit one and is used by one thread at a time (the caller
waits for the draw before touching it again), in a fixed order: a seed gives the same
numbers whether the draw runs in the background or not, namely one
``fedsgld.core.noise.gaussian_noise((B * P,), ...)`` per chunk. On a GPU the draw is
queued on the device like any other kernel; no thread is needed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from fedsgld.core.noise import gaussian_noise


def draw_in_background(generator: torch.Generator) -> bool:
    """Whether pre-noise is drawn on a second thread: CPU generators, when torch may use
    more than one thread (``threads=1`` keeps the whole step on one core)."""
    return generator.device.type == "cpu" and torch.get_num_threads() > 1


class PrenoiseRows:
    """rho * z for ``rows`` records of ``cols`` numbers each, drawn at construction.

    The draw is one flat vector of rows * cols normals (``gaussian_noise``), which
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
        if background:
            self._thread = threading.Thread(target=self._draw, name="fedsgld-prenoise")
            self._thread.start()
        else:
            self._draw()

    def _draw(self) -> None:
        try:
            self._value = gaussian_noise(self._shape, std=self._std, generator=self._generator)
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
    """Run the block with one torch thread fewer while ``noise`` is drawn on another thread,
    so that the draw and the computation share the threads torch may use."""
    if noise is None or not noise.in_background:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(max(1, n - 1))
    try:
        yield
    finally:
        torch.set_num_threads(n)
