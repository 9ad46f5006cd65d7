"""Per-record gradients of a layer from its activations and backpropagated errors: a
registry from layer type to the function that forms them (:func:`register_grad_sampler`).

For a layer o = W a + b (a dense layer; a convolution is the same on unfolded input
patches), with L = sum_i l_i the summed loss and e_i = dL/do_i the error that ordinary
backpropagation delivers at record i's output (records do not interact: no BatchNorm),
record i's gradient is

    grad_W l_i = sum_t e_{i,t} a_{i,t}^T,    grad_b l_i = sum_t e_{i,t}

where t runs over positions (one for a dense layer on vectors, the output pixels of a
convolution). A registered layer type gives, from one call's input a and output error e,
its :class:`Terms` A (B, T, d) and E (B, T, p); everything after that is the same for
every layer type. :class:`LayerGrads` runs one forward pass with hooks and one backward
pass for dL/do only (no weight gradients are formed), then:

* ``per_record``: the (B, P) matrix of per-record gradients (reference API, tests);
* ``add_into``: each layer's sum_t e_{i,t} a_{i,t}^T added in place into a buffer laid out
  parameter by parameter (:func:`fedsgld.core.clipping.param_blocks`) that already holds
  the pre-noise rho z_i (one ``baddbmm_``, or a broadcast ``addcmul_`` for a dense layer
  on vectors), so each record's g_i + rho z_i is formed once, in the noise's memory;
* ``clipped_sum_norm_first``, without pre-noise ("ghost" norms): for a dense layer on
  vectors ||grad_W l_i||^2 = ||e_i||^2 ||a_i||^2, and with T positions
  ||grad_W l_i||^2 = sum_{t,s} (a_t . a_s)(e_t . e_s) where that saves work
  (T^2 (d + p) < 2 d p for d inputs and p outputs; else the layer's per-record gradients are
  formed, and dropped after the sum). The clipped sum sum_i c_i grad l_i =
  sum_{i,t} c_i e_{i,t} a_{i,t}^T is then one matrix product of the same activations and
  errors: no second backward pass. The factors c_i come from the one clip function,
  :func:`fedsgld.core.clipping.clip_factors`; a record whose float32 squared norm is not
  finite has its gradient formed in float64 instead, and adds zero if that is not finite
  (the rule of :func:`fedsgld.core.clipping.finite_clip_factors`).

All three are exact (the same numbers as autograd on one record at a time, up to float
rounding); ``tests/core`` checks them against that loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsgld.core import clipping
from fedsgld.core.clipping import param_blocks


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
    sampler: GradSampler
    weight: _Param | None = None  # None: the weight is frozen
    bias: _Param | None = None


class Terms:
    """One layer's activations A (B, T, d) and errors E (B, T, p) of a batch.

    ``A`` is given, or made on first use by ``make_A`` (a convolution's unfolded input
    patches, a copy d / C_in times the size of its input: with pre-noise that is after the
    noise has been drawn, when the copy can use every thread). ``inputs`` is d."""

    def __init__(
        self,
        layer: _Layer,
        E: torch.Tensor,
        A: torch.Tensor | None = None,
        *,
        make_A: Callable[[], torch.Tensor] | None = None,
        inputs: int | None = None,
    ) -> None:
        if (A is None) == (make_A is None):
            raise ValueError("Terms needs A or make_A")
        self.layer = layer
        self.E = E
        self._A = A
        self._make_A = make_A
        self._inputs = int(A.shape[2]) if A is not None else int(inputs)

    @property
    def A(self) -> torch.Tensor:
        if self._A is None:
            self._A, self._make_A = self._make_A(), None
        return self._A

    @property
    def positions(self) -> int:
        return self.E.shape[1]

    @property
    def inputs(self) -> int:
        """d: the length of one position's input (a convolution's patch)."""
        return self._inputs

    def weight_grads(self) -> torch.Tensor:
        """(B, p, d) per-record weight gradients sum_t e_t a_t^T."""
        return torch.bmm(self.E.transpose(1, 2), self.A)

    def ghost_is_cheaper(self) -> bool:
        """Norm first (Gram matrices, then one weighted product) versus forming the
        per-record gradients (one batched product, then two passes over them).

        Per record: T^2 (d + p) + T d p multiply-adds against T d p + 2 d p."""
        T, d, p = self.positions, self.inputs, self.E.shape[2]
        return T == 1 or T * T * (d + p) < 2 * d * p


# -- the registry ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GradSampler:
    """How per-record gradients of one layer type are formed.

    ``check(module)`` raises :class:`UnsupportedModel` for a configuration the sampler does
    not cover; ``terms(layer, a, e, b)`` returns the layer's :class:`Terms` from its input
    ``a`` (detached) and the error ``e = dL/do`` at its output for ``b`` records, both
    records first (a module that breaks that is caught by the check against torch.func)."""

    check: Callable[[nn.Module], None]
    terms: Callable[[_Layer, torch.Tensor, torch.Tensor, int], Terms]


GRAD_SAMPLERS: dict[type[nn.Module], GradSampler] = {}


def register_grad_sampler(
    layer_type: type[nn.Module], *, check: Callable[[nn.Module], None] = lambda m: None
) -> Callable[[Callable], Callable]:
    """Register ``terms(layer, a, e, b) -> Terms`` for modules of exactly ``layer_type``."""

    def register(terms: Callable[[_Layer, torch.Tensor, torch.Tensor, int], Terms]) -> Callable:
        GRAD_SAMPLERS[layer_type] = GradSampler(check=check, terms=terms)
        return terms

    return register


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


@register_grad_sampler(nn.Linear)
def _linear_terms(layer: _Layer, a: torch.Tensor, e: torch.Tensor, b: int) -> Terms:
    """o = W a + b on the last axis: every other axis after the records is a position."""
    return Terms(layer, e.reshape(b, -1, e.shape[-1]), a.reshape(b, -1, a.shape[-1]))


def _check_conv(conv: nn.Module) -> None:
    if conv.groups != 1:
        raise UnsupportedModel("Conv2d with groups > 1")
    if conv.padding_mode != "zeros":
        raise UnsupportedModel(f"Conv2d padding_mode={conv.padding_mode!r}")
    _conv_padding(conv)


@register_grad_sampler(nn.Conv2d, check=_check_conv)
def _conv_terms(layer: _Layer, a: torch.Tensor, e: torch.Tensor, b: int) -> Terms:
    """A convolution is a dense layer on its input patches (unfolded when first used)."""
    conv = layer.module
    kh, kw = conv.kernel_size
    E = e.reshape(b, e.shape[1], -1).transpose(1, 2)
    return Terms(
        layer,
        E,
        make_A=lambda: unfold_patches(a, conv).transpose(1, 2),  # (B, L, d)
        inputs=conv.in_channels * kh * kw,
    )


class LayerGrads:
    """Per-record gradients of a module whose trainable parameters all sit in layers of a
    registered type (:data:`GRAD_SAMPLERS`: Linear; Conv2d with groups 1, zero padding),
    each layer called once per forward pass.

    ``names`` and ``numels`` are the flat parameter order of
    :class:`~fedsgld.core.mechanism.FlatModel`. Raises :class:`UnsupportedModel` for
    anything else (the caller then uses ``torch.func``).
    """

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
            sampler = GRAD_SAMPLERS.get(type(m))
            if sampler is None:
                if any(p.requires_grad for _, p in own):
                    raise UnsupportedModel(f"trainable parameters in {type(m).__name__}")
                continue
            sampler.check(m)
            entry = _Layer(m, sampler)
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
            raise UnsupportedModel(f"parameters outside supported layers: {missing[:3]}")
        self.layers = layers
        self.size = pos
        self.numels = list(numels)

    # -- one forward and one backward pass --------------------------------------------------
    def terms(
        self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> list[Terms]:
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
        return [
            entry.sampler.terms(entry, a.detach(), e, b)
            for (entry, a, _o), e in zip(called, errs, strict=True)
            if e is not None  # else the layer does not reach the loss: zero gradient
        ]

    # -- the three uses -------------------------------------------------------------------
    @staticmethod
    def add_into(blocks: list[torch.Tensor], terms: list[Terms]) -> list[torch.Tensor]:
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

    def clipped_sum_norm_first(self, terms: list[Terms], clip: float, b: int) -> torch.Tensor:
        """sum_i min(1, C / ||g_i||) g_i from activations and errors (no pre-noise)."""
        device = terms[0].E.device if terms else None
        total = torch.zeros(self.size, dtype=torch.float32, device=device)
        if not terms:
            return total
        sq = torch.zeros(b, dtype=torch.float32, device=device)
        kept: list[tuple[Terms, torch.Tensor | None, torch.Tensor | None]] = []
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
        c = clipping.clip_factors(sq, clip)
        bad = ~torch.isfinite(sq)
        odd = bad.nonzero(as_tuple=True)[0] if bool(bad.any()) else None
        if odd is not None:  # rare: these records' sum is formed in float64 below
            c[odd] = 0.0
        for t, G, bg in kept:
            w, bias = t.layer.weight, t.layer.bias
            E = t.E if odd is None else t.E.index_fill(0, odd, 0.0)  # 0 * inf is NaN
            if w is not None:
                if G is not None:
                    G = G if odd is None else G.index_fill(0, odd, 0.0)
                    part = c @ G.reshape(b, -1)
                else:
                    A = t.A if odd is None else t.A.index_fill(0, odd, 0.0)
                    p, d = E.shape[2], A.shape[2]
                    ce = (E * c.view(b, 1, 1)).reshape(-1, p)
                    part = (ce.T @ A.reshape(-1, d)).reshape(-1)
                total[w.offset : w.offset + w.numel] = part
            if bias is not None:
                bg = bg if odd is None else bg.index_fill(0, odd, 0.0)
                total[bias.offset : bias.offset + bias.numel] = c @ bg
        if odd is not None:
            total += self._exact_clipped_sum(terms, odd, clip)
        return total

    def _exact_clipped_sum(self, terms: list[Terms], idx: torch.Tensor, clip: float):
        """sum over records ``idx`` of clip_C(g_i), each g_i formed in float64 from its
        activations and errors (so neither it nor its norm overflows for finite float32
        inputs); a record whose g_i is not finite (an inf or NaN activation or error)
        adds zero (:func:`fedsgld.core.clipping.finite_clip_factors`' rule)."""
        k = idx.shape[0]
        parts: list[tuple[int, torch.Tensor]] = []
        sq = torch.zeros(k, dtype=torch.float64, device=idx.device)
        for t in terms:
            E = t.E[idx].double()
            grads = []
            if t.layer.weight is not None:
                grads.append((t.layer.weight, torch.bmm(E.transpose(1, 2), t.A[idx].double())))
            if t.layer.bias is not None:
                grads.append((t.layer.bias, E.sum(1)))
            for param, g in grads:
                g = g.reshape(k, -1)
                sq += g.square().sum(1)
                parts.append((param.offset, g))
        ok = torch.isfinite(sq)
        c = torch.where(ok, (clip / (sq.sqrt() + 1e-12)).clamp(max=1.0), torch.zeros_like(sq))
        out = torch.zeros(self.size, dtype=torch.float32, device=idx.device)
        for offset, g in parts:
            g = g.masked_fill(~ok.unsqueeze(1), 0.0)
            out[offset : offset + g.shape[1]] = (c @ g).float()
        return out
