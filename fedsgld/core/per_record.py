"""Per-record gradients of Linear and Conv2d layers from activations and backpropagated errors.

For a layer o = W a + b (a dense layer; a convolution is the same on unfolded input
patches), with L = sum_i l_i the summed loss and e_i = dL/do_i the error that ordinary
backpropagation delivers at record i's output (records do not interact: no BatchNorm),
record i's gradient is

    grad_W l_i = sum_t e_{i,t} a_{i,t}^T,    grad_b l_i = sum_t e_{i,t}

where t runs over positions (one for a dense layer on vectors, the output pixels of a
convolution). One forward pass with hooks keeps each layer's input a and output o; one
backward pass asks autograd for dL/do only (no weight gradients are formed); batched
matrix products then give the per-record gradients. They are used three ways:

* ``per_record``: the (B, P) matrix of per-record gradients (reference API, tests).
* ``add_into`` then ``clip_blocks_and_sum``, with pre-noise: the buffer already holding
  rho z_i, laid out parameter by parameter (one contiguous (B, numel_j) block per
  parameter, :func:`param_blocks`), receives each layer's sum_t e_{i,t} a_{i,t}^T in place
  (one ``baddbmm_``, or a broadcast ``addcmul_`` for a dense layer on vectors), so each
  record's g_i + rho z_i is formed once, in the noise's memory; then one pass for the norms
  and one matrix-vector product per block for sum_i c_i (g_i + rho z_i),
  c_i = min(1, C / ||g_i + rho z_i||).
* ``clipped_sum_norm_first``, without pre-noise ("ghost" norms): for a dense layer on
  vectors ||grad_W l_i||^2 = ||e_i||^2 ||a_i||^2, and with T positions
  ||grad_W l_i||^2 = sum_{t,s} (a_t . a_s)(e_t . e_s) where that saves work
  (T^2 (d + p) < 2 d p for d inputs and p outputs; else the layer's per-record gradients are
  formed, and dropped after the sum). The clipped sum sum_i c_i grad l_i =
  sum_{i,t} c_i e_{i,t} a_{i,t}^T is then one matrix product of the same activations and
  errors: no second backward pass.

All three are exact (the same numbers as autograd on one record at a time, up to float
rounding); ``tests/core`` checks them against that loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsgld.core.noise import gaussian_noise


class UnsupportedModel(Exception):
    """The module cannot use layer-wise per-record gradients (the reason is the message)."""


@dataclass
class _Param:
    index: int  # position in the list of trainable parameters
    offset: int  # position in the flat parameter vector
    numel: int


@dataclass
class _Layer:
    module: nn.Module
    weight: _Param | None  # None: the weight is frozen
    bias: _Param | None


class _Terms:
    """One layer's activations A (B, T, d) and errors E (B, T, p) of a batch.

    A convolution's A (its unfolded input patches, a copy d / C_in times the size of its
    input) is formed on first use, not in the forward pass: with pre-noise that is after the
    noise has been drawn, when the copy can use every thread."""

    def __init__(
        self,
        layer: _Layer,
        E: torch.Tensor,
        A: torch.Tensor | None = None,
        *,
        conv_input: torch.Tensor | None = None,
    ) -> None:
        if (A is None) == (conv_input is None):
            raise ValueError("_Terms needs A or a convolution's input")
        self.layer = layer
        self.E = E
        self._A = A
        self._conv_input = conv_input

    @property
    def A(self) -> torch.Tensor:
        if self._A is None:
            conv = self.layer.module
            assert isinstance(conv, nn.Conv2d) and self._conv_input is not None
            self._A = unfold_patches(self._conv_input, conv).transpose(1, 2)  # (B, L, d)
            self._conv_input = None
        return self._A

    @property
    def positions(self) -> int:
        return self.E.shape[1]

    @property
    def inputs(self) -> int:
        """d: the length of one position's input (a convolution's patch)."""
        if self._A is not None:
            return self._A.shape[2]
        conv = self.layer.module
        kh, kw = conv.kernel_size
        return conv.in_channels * kh * kw

    def weight_grads(self) -> torch.Tensor:
        """(B, p, d) per-record weight gradients sum_t e_t a_t^T."""
        return torch.bmm(self.E.transpose(1, 2), self.A)

    def ghost_is_cheaper(self) -> bool:
        """Norm first (Gram matrices, then one weighted product) versus forming the
        per-record gradients (one batched product, then two passes over them).

        Per record: T^2 (d + p) + T d p multiply-adds against T d p + 2 d p."""
        T, d, p = self.positions, self.inputs, self.E.shape[2]
        return T == 1 or T * T * (d + p) < 2 * d * p


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int]:
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0)
        raise UnsupportedModel(f"Conv2d padding={conv.padding!r}")
    return (int(conv.padding[0]), int(conv.padding[1]))


def unfold_patches(a: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """(B, C * kh * kw, L) input patches of ``conv`` (the columns of its im2col matrix).

    Same layout as ``torch.nn.functional.unfold`` (channel-major, then kernel rows and
    columns), built from one strided view and one copy, which is several times faster than
    ``F.unfold`` on the CPU.
    """
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    ph, pw = _conv_padding(conv)
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    a = a.contiguous()
    b, c, h, w = a.shape
    oh = (h - dh * (kh - 1) - 1) // sh + 1
    ow = (w - dw * (kw - 1) - 1) // sw + 1
    s0, s1, s2, s3 = a.stride()
    patches = a.as_strided((b, c, kh, kw, oh, ow), (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw))
    return patches.reshape(b, c * kh * kw, oh * ow)


def _has_batch_coupling(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class LayerGrads:
    """Per-record gradients of a module whose trainable parameters all sit in Linear or
    Conv2d layers (groups 1, zero padding), each layer called once per forward pass.

    ``names`` and ``numels`` are the flat parameter order of :class:`FlatModel`. Raises
    :class:`UnsupportedModel` for anything else (the caller then uses ``torch.func``).
    """

    SUPPORTED = (nn.Linear, nn.Conv2d)

    def __init__(self, module: nn.Module, names: list[str], numels: list[int]) -> None:
        if _has_batch_coupling(module):
            raise UnsupportedModel("BatchNorm couples the records of a batch")
        offsets = {}
        pos = 0
        for i, (n, k) in enumerate(zip(names, numels, strict=True)):
            offsets[n] = _Param(i, pos, k)
            pos += k
        owner: dict[str, _Layer] = {}
        layers: list[_Layer] = []
        claimed: set[int] = set()
        for prefix, m in module.named_modules():
            own = list(m.named_parameters(recurse=False))
            if not own:
                continue
            if type(m) not in self.SUPPORTED:
                if any(p.requires_grad for _, p in own):
                    raise UnsupportedModel(f"trainable parameters in {type(m).__name__}")
                continue
            if isinstance(m, nn.Conv2d):
                if m.groups != 1:
                    raise UnsupportedModel("Conv2d with groups > 1")
                if m.padding_mode != "zeros":
                    raise UnsupportedModel(f"Conv2d padding_mode={m.padding_mode!r}")
                _conv_padding(m)
            entry = _Layer(m, None, None)
            for pname, p in own:
                full = f"{prefix}.{pname}" if prefix else pname
                if full in offsets:
                    if id(p) in claimed:
                        raise UnsupportedModel(f"parameter {full} is shared between layers")
                    claimed.add(id(p))
                    setattr(entry, pname, offsets[full])
                    owner[full] = entry
            if entry.weight is not None or entry.bias is not None:
                layers.append(entry)
        missing = [n for n in names if n not in owner]
        if missing:
            raise UnsupportedModel(f"parameters outside Linear/Conv2d layers: {missing[:3]}")
        self.layers = layers
        self.size = pos
        self.numels = list(numels)

    # -- one forward and one backward pass --------------------------------------------------
    def terms(
        self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> list[_Terms]:
        """Activations and errors of every layer for the records (x, y).

        ``forward(x)`` must build the autograd graph with the layer parameters requiring
        grad (the caller passes views of a leaf theta).
        """
        seen: dict[nn.Module, list] = {}

        def keep(mod, inputs, output):
            seen.setdefault(mod, []).append(
                (inputs[0], output, inputs[0]._version, output._version)
            )

        handles = [entry.module.register_forward_hook(keep) for entry in self.layers]
        try:
            logits = forward(x)
        finally:
            for h in handles:
                h.remove()
        called = []
        for entry in self.layers:
            calls = seen.get(entry.module, [])
            if len(calls) > 1:
                raise UnsupportedModel(f"{type(entry.module).__name__} called twice per forward")
            if calls:
                a, o, a_version, o_version = calls[0]
                if a._version != a_version or o._version != o_version:
                    raise UnsupportedModel("a layer input or output was modified in place")
                if not o.requires_grad:
                    raise UnsupportedModel("a layer ran without autograd")
                called.append((entry, a, o))
        if not called:
            return []
        loss = F.cross_entropy(logits, y, reduction="sum")
        errs = torch.autograd.grad(loss, [o for _, _, o in called], allow_unused=True)
        b = x.shape[0]
        out = []
        for (entry, a, _o), e in zip(called, errs, strict=True):
            if e is None:
                continue  # the layer does not reach the loss: zero gradient
            m = entry.module
            if isinstance(m, nn.Conv2d):  # A: unfolded when first used
                E = e.reshape(b, e.shape[1], -1).transpose(1, 2)
                out.append(_Terms(entry, E, conv_input=a.detach()))
            else:
                A = a.detach().reshape(b, -1, a.shape[-1])
                out.append(_Terms(entry, e.reshape(b, -1, e.shape[-1]), A))
        return out

    # -- the three uses -------------------------------------------------------------------
    @staticmethod
    def add_into(blocks: list[torch.Tensor], terms: list[_Terms]) -> list[torch.Tensor]:
        """blocks[j][i] += record i's gradient of parameter j, in place.

        ``blocks`` holds one contiguous (B, numel_j) tensor per trainable parameter (the
        parameter-major layout of :func:`param_blocks`), so every layer's per-record
        gradients are written by one batched product straight into their block."""
        for t in terms:
            w, bias = t.layer.weight, t.layer.bias
            if w is not None:
                block = blocks[w.index]
                b, p, d = block.shape[0], t.E.shape[2], t.A.shape[2]
                if t.positions == 1:  # outer products e_i a_i^T: a broadcast multiply-add
                    block.view(b, p, d).addcmul_(t.E.transpose(1, 2), t.A)
                else:
                    block.view(b, p, d).baddbmm_(t.E.transpose(1, 2), t.A)
            if bias is not None:
                blocks[bias.index] += t.E.sum(1)
        return blocks

    def per_record(
        self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """(B, P) matrix of per-record gradients, rows in the flat parameter order."""
        b = x.shape[0]
        flat = torch.zeros(b * self.size, dtype=torch.float32, device=x.device)
        blocks = param_blocks(flat, b, self.numels)
        self.add_into(blocks, self.terms(forward, x, y))
        return torch.cat(blocks, dim=1)

    def clipped_sum_norm_first(self, terms: list[_Terms], clip: float, b: int) -> torch.Tensor:
        """sum_i min(1, C / ||g_i||) g_i from activations and errors (no pre-noise)."""
        device = terms[0].E.device if terms else None
        total = torch.zeros(self.size, dtype=torch.float32, device=device)
        if not terms:
            return total
        sq = torch.zeros(b, dtype=torch.float32, device=device)
        kept: list[tuple[_Terms, torch.Tensor | None, torch.Tensor | None]] = []
        for t in terms:
            G = bg = None
            if t.layer.weight is not None:
                if t.positions == 1:
                    sq += t.E.square().sum((1, 2)) * t.A.square().sum((1, 2))
                elif t.ghost_is_cheaper():
                    gram_a = torch.bmm(t.A, t.A.transpose(1, 2))
                    gram_e = torch.bmm(t.E, t.E.transpose(1, 2))
                    sq += (gram_a * gram_e).sum((1, 2))
                else:
                    G = t.weight_grads()
                    sq += G.square().sum((1, 2))
            if t.layer.bias is not None:
                bg = t.E.sum(1)
                sq += bg.square().sum(1)
            kept.append((t, G, bg))
        c = clip_factors(sq, clip)
        for t, G, bg in kept:
            w, bias = t.layer.weight, t.layer.bias
            if w is not None:
                if G is not None:
                    part = c @ G.reshape(b, -1)
                else:
                    p, d = t.E.shape[2], t.A.shape[2]
                    ce = (t.E * c.view(b, 1, 1)).reshape(-1, p)
                    part = (ce.T @ t.A.reshape(-1, d)).reshape(-1)
                total[w.offset : w.offset + w.numel] = part
            if bias is not None:
                total[bias.offset : bias.offset + bias.numel] = c @ bg
        return total


def param_blocks(flat: torch.Tensor, rows: int, numels: list[int]) -> list[torch.Tensor]:
    """View a flat buffer of ``rows * sum(numels)`` numbers as one contiguous (rows, numel_j)
    block per parameter, in order (parameter-major: block j holds every record's
    values of parameter j). Row i of ``torch.cat(blocks, 1)`` is record i's flat vector."""
    if flat.numel() != rows * sum(numels):
        raise ValueError(f"buffer of {flat.numel()} numbers is not {rows} x {sum(numels)}")
    out, pos = [], 0
    for k in numels:
        out.append(flat[pos : pos + rows * k].view(rows, k))
        pos += rows * k
    return out


def clip_blocks_and_sum(blocks: list[torch.Tensor], clip: float | None) -> torch.Tensor:
    """sum_i min(1, C / ||v_i||) v_i for the records' vectors v_i = row i of cat(blocks, 1).

    The same as ``fedsgld.core.clipping.clip_and_sum`` on the concatenated matrix (with
    no pre-noise: any is already in the blocks), without forming it. ``clip=None``: the
    plain sum."""
    if clip is None:
        return torch.cat([blk.sum(0) for blk in blocks])
    sq = None
    for blk in blocks:
        n = torch.linalg.vector_norm(blk, dim=1).square()
        sq = n if sq is None else sq.add_(n)
    return torch.cat([clip_factors(sq, clip) @ blk for blk in blocks])


def clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """c_i = min(1, C / ||v_i||) from the squared norms ||v_i||^2: the one place every
    per-record clipping path (and the audit's canaries, :func:`fedsgld.core.mechanism.site_step`)
    takes its factors from, so that each record's clipped vector has norm <= C."""
    return (clip / (squared_norms.sqrt() + 1e-12)).clamp_(max=1.0)


def clipped_rows_sum(
    rows: torch.Tensor,
    sizes: list[int],
    *,
    clip: float | None,
    prenoise: float,
    generator: torch.Generator,
    chunk_size: int = 256,
) -> torch.Tensor:
    """sum_i clip_C(v_i + rho z_i) for records given by their gradients v_i (rows of a
    (k, P) matrix on the generator's device, P = sum(sizes)): the pre-noise rho z_i drawn
    from ``generator`` laid out parameter by parameter (:func:`param_blocks` with the
    parameter sizes ``sizes``), then :func:`clip_blocks_and_sum`, in chunks of ``chunk_size``
    records. The records' own path with pre-noise, for gradients that need no model."""
    size = sum(sizes)
    if rows.dim() != 2 or rows.shape[1] != size:
        raise ValueError(f"rows must be (records, {size}), got {tuple(rows.shape)}")
    total = torch.zeros(size, dtype=torch.float32, device=rows.device)
    for start in range(0, rows.shape[0], chunk_size):
        part = rows[start : start + chunk_size]
        k = part.shape[0]
        flat = gaussian_noise((k * size,), std=prenoise, generator=generator).to(rows.device)
        blocks = param_blocks(flat, k, sizes)
        pos = 0
        for blk in blocks:
            blk += part[:, pos : pos + blk.shape[1]]
            pos += blk.shape[1]
        total += clip_blocks_and_sum(blocks, clip)
    return total
