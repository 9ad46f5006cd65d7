"""Per-record gradient paths against the one-record-at-a-time loop, pre-noise, and devices.

Every path (``layers``: materialised, pre-noised and norm-first clipped sums; ``func``) on
every model (the paper CNN, the MLP, logistic regression, the dense head over backbone
features), on the CPU and, when one is present, on a GPU.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from fedsgld.config import PerfSettings
from fedsgld.core.device import resolve_device
from fedsgld.core.mechanism import (
    FlatModel,
    clipped_gradient_sum,
    langevin_update,
    site_step,
)
from fedsgld.core.noise import gaussian_noise, seeded_generator
from fedsgld.core.per_record import unfold_patches
from fedsgld.core.prenoise import PrenoiseRows, prenoise_values
from fedsgld.models import build_model

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
MODELS = {"cnn": (1, 28, 28), "mlp": (1, 28, 28), "logreg": (1, 28, 28), "timm_head": (96,)}


@pytest.fixture(autouse=True)
def full_float32_on_gpu():
    """Compare with the loop in full float32: no TF32 matrix products or convolutions."""
    if not CUDA:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def loop_grads(fm: FlatModel, theta, x, y):
    """The reference: autograd on one record at a time."""
    rows = []
    for i in range(x.shape[0]):
        t = theta.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(fm.logits(t, x[i : i + 1]), y[i : i + 1])
        (g,) = torch.autograd.grad(loss, t)
        rows.append(g)
    return torch.stack(rows)


def noise_matrix(rows, numels, *, std, generator):
    """rho z for a chunk: one flat draw of rows * P normals, laid out parameter by
    parameter (the first rows * numel_0 numbers are parameter 0 of every record, ...)."""
    z = prenoise_values(rows * sum(numels), std=std, generator=generator)
    cols, pos = [], 0
    for k in numels:
        cols.append(z[pos : pos + rows * k].reshape(rows, k))
        pos += rows * k
    return torch.cat(cols, 1)


def reference_sum(grads, *, clip, prenoise, seed, chunk, numels):
    """sum_i clip(g_i + rho z_i) with z drawn as ``noise_matrix`` for each chunk of records."""
    gen = torch.Generator(device=grads.device).manual_seed(seed)
    total = torch.zeros(grads.shape[1], dtype=grads.dtype, device=grads.device)
    for s in range(0, grads.shape[0], chunk):
        g = grads[s : s + chunk]
        if prenoise > 0:
            g = g + noise_matrix(g.shape[0], numels, std=prenoise, generator=gen)
        if clip is None:
            total += g.sum(0)
        else:
            f = (clip / (g.norm(dim=1) + 1e-12)).clamp(max=1.0)
            total += f @ g
    return total


def setup(name, device, n=7, seed=0):
    torch.manual_seed(seed)
    module = build_model(name, input_shape=MODELS[name], num_classes=5, hidden=12)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, *MODELS[name], generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return module, x.to(device), y.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["layers", "func"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_record_grads_match_the_loop(name, path, device):
    module, x, y = setup(name, device)
    fm = FlatModel(module, device=device, grad_path=path)
    assert fm.grad_path == path
    theta = fm.flatten()
    # move theta off its initial values so that no layer sits at a special point
    theta = theta + 0.05 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(4)).to(
        theta.device
    )
    got = fm.per_record_grads(theta, x, y)
    ref = loop_grads(fm, theta, x, y)
    assert got.shape == ref.shape == (x.shape[0], fm.size)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    assert (ref[0] - ref[1]).abs().max() > 1e-4  # records differ: a broadcast bug would show


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["layers", "func"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prenoise", [0.0, 0.02])
def test_clipped_sums_match_the_loop(name, path, device, prenoise):
    """Norm-first (rho = 0) and pre-noised (rho > 0) clipped sums on each path."""
    module, x, y = setup(name, device)
    fm = FlatModel(module, device=device, grad_path=path)
    theta = fm.flatten()
    ref_grads = loop_grads(fm, theta, x, y)
    clip = float(ref_grads.norm(dim=1).median())  # some records clipped, some not
    for chunk in (3, 256):
        for c in (clip, None) if prenoise > 0 else (clip,):
            gen = torch.Generator(device=device).manual_seed(11)
            got = clipped_gradient_sum(
                fm, theta, x, y, clip=c, prenoise=prenoise, generator=gen, chunk_size=chunk
            )
            ref = reference_sum(
                ref_grads, clip=c, prenoise=prenoise, seed=11, chunk=chunk, numels=fm.numels
            )
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


class ConvZoo(nn.Module):
    """Every branch of the layer path: convolutions with stride, dilation, asymmetric and
    'valid' padding, no bias, a frozen layer, dense layers on positions (B, T, d), and on
    positions both norm-first branches (Gram matrices when T^2 (d + p) < 2 d p, else the
    per-record gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 8, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
        self.b = nn.Conv2d(8, 16, 3, stride=2, bias=False, padding="valid")
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.seq = nn.Linear(64, 48)  # T = 2 positions: Gram matrices
        self.head = nn.Linear(48, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))  # (B, 16, 2, 4)
        h = self.frozen(h.permute(0, 2, 1, 3).reshape(x.shape[0], 2, 64))  # (B, 2, 64)
        h = torch.tanh(self.seq(h))  # (B, 2, 48)
        return self.head(h.mean(1))


def test_layer_path_branches_match_the_loop():
    torch.manual_seed(3)
    fm = FlatModel(ConvZoo())
    assert fm.grad_path == "layers"
    assert "frozen.weight" not in fm.names
    x, y = torch.randn(5, 2, 9, 8), torch.randint(0, 3, (5,))
    theta = fm.flatten()
    terms = fm.grads.layers.terms(fm.grads.leaf_forward(theta), x, y)
    branches = {(t.positions > 1, t.ghost_is_cheaper()) for t in terms}
    assert branches == {(True, True), (True, False), (False, True)}
    ref = loop_grads(fm, theta, x, y)
    torch.testing.assert_close(fm.per_record_grads(theta, x, y), ref, rtol=1e-4, atol=1e-6)
    clip = float(ref.norm(dim=1).median())
    for rho in (0.0, 0.1):
        got = clipped_gradient_sum(
            fm, theta, x, y, clip=clip, prenoise=rho, generator=torch.Generator().manual_seed(2)
        )
        expected = reference_sum(ref, clip=clip, prenoise=rho, seed=2, chunk=256, numels=fm.numels)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_unfold_patches_is_unfold():
    x = torch.randn(3, 2, 11, 10)
    for conv in (
        nn.Conv2d(2, 4, 3),
        nn.Conv2d(2, 4, (3, 2), stride=(2, 3), padding=(1, 2), dilation=(2, 1)),
        nn.Conv2d(2, 4, 8, stride=2, padding=3),
    ):
        ref = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
        assert torch.equal(unfold_patches(x, conv), ref)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.fc(x).tanh_())


class SequenceFirst(nn.Module):
    """A dense layer that sees (T, B, d): the records are not along its first axis."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # x: (B, T, 3)
        h = torch.tanh(self.fc(x.transpose(0, 1)))  # (T, B, 4)
        return self.out(h.mean(0))


class BatchCentred(nn.Module):
    """Records meet outside the loss: each is centred on the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)))


@pytest.mark.parametrize("cls", [Twice, InPlace, SequenceFirst, BatchCentred])
def test_layer_path_falls_back_when_a_forward_breaks_its_assumptions(cls):
    torch.manual_seed(0)
    fm = FlatModel(cls())
    assert fm.grad_path == "layers"  # decided from the modules; the forward tells otherwise
    x = torch.randn(4, 5, 3) if cls is SequenceFirst else torch.randn(4, 6)
    y = torch.randint(0, 2 if cls is SequenceFirst else 3, (4,))
    theta = fm.flatten()
    with pytest.warns(UserWarning, match="fall back"):
        got = fm.per_record_grads(theta, x, y)
    assert fm.grad_path == "func"
    torch.testing.assert_close(got, loop_grads(fm, theta, x, y), rtol=1e-4, atol=1e-6)
    fm2 = FlatModel(cls())
    fm2.module.load_state_dict(fm.module.state_dict())
    with pytest.warns(UserWarning, match="fall back"):
        s = clipped_gradient_sum(fm2, theta, x, y, clip=0.1)
    torch.testing.assert_close(
        s,
        reference_sum(
            loop_grads(fm, theta, x, y), clip=0.1, prenoise=0, seed=0, chunk=256, numels=fm.numels
        ),
    )


def test_unsupported_modules_use_torch_func():
    assert FlatModel(WithNorm()).grad_path == "func"
    assert FlatModel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))).grad_path == "func"
    with pytest.raises(ValueError, match="grad_path='layers'"):
        FlatModel(WithNorm(), grad_path="layers")
    with pytest.raises(ValueError, match="grad_path must be one of"):
        FlatModel(Twice(), grad_path="ghost")
    torch.manual_seed(1)
    fm = FlatModel(WithNorm())
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    theta = fm.flatten()
    torch.testing.assert_close(
        fm.per_record_grads(theta, x, y), loop_grads(fm, theta, x, y), rtol=1e-4, atol=1e-6
    )


def test_variational_models_keep_their_own_gradients():
    from fedsgld.vi.model import VariationalModel

    vm = VariationalModel(build_model("mlp", input_shape=(4,), num_classes=3, hidden=5))
    assert vm.grad_path == "func"  # its gradients are with respect to phi = [mu, rho]
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    assert vm.per_record_grads(vm.flatten(), x, y).shape == (3, vm.size)


# -- pre-noise ------------------------------------------------------------------------------
def test_prenoise_has_the_claimed_distribution_and_is_independent_per_record():
    """With no clipping, S - sum_i g_i = rho sum_i z_i ~ N(0, n rho^2) in every coordinate.

    The KS test on the P = 26,010 coordinates of the CNN accepts rho and rejects 2/3 and 3/2
    of it; records sharing one z (or chunks reusing a stream) would give std n rho instead
    of sqrt(n) rho, which the same test rejects.
    """
    module, x, y = setup("cnn", "cpu", n=4)
    fm = FlatModel(module)
    theta = fm.flatten()
    grads_sum = loop_grads(fm, theta, x, y).sum(0)
    rho = 0.3
    for chunk in (4, 2):
        s = clipped_gradient_sum(
            fm,
            theta,
            x,
            y,
            clip=None,
            prenoise=rho,
            generator=torch.Generator().manual_seed(5),
            chunk_size=chunk,
        )
        d = (s - grads_sum).numpy()
        sd = rho * math.sqrt(4)
        assert stats.kstest(d, "norm", args=(0, sd)).pvalue > 1e-3
        for wrong in (2 / 3 * sd, 3 / 2 * sd, 2 * sd):  # 2 sd = n rho: one z for all records
            assert stats.kstest(d, "norm", args=(0, wrong)).pvalue < 1e-10


@pytest.mark.parametrize("path", ["layers", "func"])
def test_every_record_is_clipped_after_its_prenoise(path):
    """One record at a time: ||S|| = C exactly when ||g + rho z|| > C, S points along
    g + rho z, and the sum over records of those clipped vectors is what the step returns."""
    module, x, y = setup("mlp", "cpu", n=6)
    fm = FlatModel(module, grad_path=path)
    theta = fm.flatten()
    ref = loop_grads(fm, theta, x, y)
    rho, C = 0.05, 0.2  # ||rho z|| ~ 0.05 sqrt(P) >> C: every pre-noised record is clipped
    for i in range(x.shape[0]):
        s = clipped_gradient_sum(
            fm,
            theta,
            x[i : i + 1],
            y[i : i + 1],
            clip=C,
            prenoise=rho,
            generator=torch.Generator().manual_seed(i),
        )
        z = prenoise_values(fm.size, std=rho, generator=torch.Generator().manual_seed(i))
        v = ref[i] + z
        assert v.norm() > C
        assert abs(float(s.norm()) - C) < 1e-5 * C
        torch.testing.assert_close(s, C * v / v.norm(), rtol=1e-4, atol=1e-6)
        # clipping before the pre-noise would leave a norm near ||rho z||, far above C
        assert float((C * ref[i] / ref[i].norm() + z).norm()) > 2 * C
    whole = clipped_gradient_sum(
        fm, theta, x, y, clip=C, prenoise=rho, generator=torch.Generator().manual_seed(9)
    )
    assert whole.norm() <= x.shape[0] * C * (1 + 1e-5)
    torch.testing.assert_close(
        whole,
        reference_sum(ref, clip=C, prenoise=rho, seed=9, chunk=256, numels=fm.numels),
        rtol=1e-4,
        atol=1e-6,
    )


def test_prenoise_is_deterministic_for_a_seed_in_the_background_or_not():
    module, x, y = setup("cnn", "cpu", n=5)
    fm = FlatModel(module)
    theta = fm.flatten()
    rows = []
    for background in (True, False, True):
        p = PrenoiseRows(
            5, fm.size, std=0.1, generator=seeded_generator(3, 4), background=background
        )
        rows.append(p.result())
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])
    torch.testing.assert_close(
        rows[0], prenoise_values(5 * fm.size, std=0.1, generator=seeded_generator(3, 4))
    )
    a = site_step(
        fm, theta, x, y, sample_rate=0.7, clip=0.5, prenoise=0.1, generator=seeded_generator(1, 2)
    )
    b = site_step(
        fm, theta, x, y, sample_rate=0.7, clip=0.5, prenoise=0.1, generator=seeded_generator(1, 2)
    )
    assert torch.equal(a, b)
    c = site_step(
        fm, theta, x, y, sample_rate=0.7, clip=0.5, prenoise=0.1, generator=seeded_generator(1, 3)
    )
    assert not torch.equal(a, c)
    # one torch thread: the draw stays on the calling thread; the same numbers, summed
    # in another order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = site_step(
            fm,
            theta,
            x,
            y,
            sample_rate=0.7,
            clip=0.5,
            prenoise=0.1,
            generator=seeded_generator(1, 2),
            chunk_size=2,
        )
    finally:
        torch.set_num_threads(threads)
    e = site_step(
        fm,
        theta,
        x,
        y,
        sample_rate=0.7,
        clip=0.5,
        prenoise=0.1,
        generator=seeded_generator(1, 2),
        chunk_size=2,
    )
    torch.testing.assert_close(d, e, rtol=1e-5, atol=1e-6)


def test_prenoise_needs_a_generator_and_a_valid_std():
    module, x, y = setup("logreg", "cpu", n=3)
    fm = FlatModel(module)
    theta = fm.flatten()
    with pytest.raises(ValueError, match="Generator"):
        clipped_gradient_sum(fm, theta, x, y, clip=1.0, prenoise=0.1)
    with pytest.raises(ValueError, match="prenoise"):
        clipped_gradient_sum(fm, theta, x, y, clip=1.0, prenoise=-0.1, generator=torch.Generator())
    with pytest.raises(ValueError, match="chunk_size"):
        clipped_gradient_sum(fm, theta, x, y, clip=1.0, chunk_size=0)
    p = PrenoiseRows(2, 3, std=float("nan"), generator=torch.Generator(), background=True)
    with pytest.raises(ValueError, match="std"):
        p.result()


# -- devices ------------------------------------------------------------------------------
def test_device_setting_is_validated_and_resolved():
    assert PerfSettings().device == "cpu"
    assert PerfSettings(device="auto").device == "auto"
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, auto"):
        PerfSettings(device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    assert PerfSettings(device="auto").torch_device().type == ("cuda" if CUDA else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    if not CUDA:
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            PerfSettings(device="cuda").torch_device()
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            FlatModel(nn.Linear(2, 2), device="cuda")


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_site_step_and_update_run_on_the_gpu_with_a_gpu_generator():
    module, x, y = setup("cnn", "cpu", n=40)
    fm = FlatModel(copy.deepcopy(module), device="cuda")
    theta = fm.flatten()
    assert theta.device.type == "cuda"
    gen = seeded_generator(0, 1, 2, device="cuda")
    s = site_step(fm, theta, x, y, sample_rate=0.5, clip=1.0, prenoise=0.01, generator=gen)
    assert s.device.type == "cuda" and torch.isfinite(s).all()
    noisy = s + gaussian_noise(s.shape, std=1.0, generator=gen)
    new = langevin_update(theta, noisy, step_size=0.1, expected_batch=20.0, weight_decay=0.0)
    assert new.device.type == "cuda"
    probs = fm.predict_proba(new, x)
    assert probs.device == x.device and torch.allclose(probs.sum(1), torch.ones(40))
    with pytest.raises(ValueError, match="generator draws on cpu"):
        site_step(
            fm, theta, x, y, sample_rate=0.5, clip=1.0, prenoise=0.01, generator=torch.Generator()
        )
    cpu = FlatModel(copy.deepcopy(module))
    torch.testing.assert_close(
        fm.per_record_grads(theta, x, y).cpu(),
        loop_grads(cpu, theta.cpu(), x, y),
        rtol=1e-3,
        atol=1e-5,
    )


def test_predict_proba_returns_on_the_records_device():
    module, x, _ = setup("mlp", "cpu", n=9)
    fm = FlatModel(module, device="cpu")
    p = fm.predict_proba(fm.flatten(), x, batch=4)
    assert p.shape == (9, 5) and p.device == x.device
    torch.testing.assert_close(p.sum(1), torch.ones(9))


def test_no_stray_warnings_on_the_supported_models():
    for name in MODELS:
        module, x, y = setup(name, "cpu", n=3)
        fm = FlatModel(module)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clipped_gradient_sum(
                fm, fm.flatten(), x, y, clip=1.0, prenoise=0.1, generator=torch.Generator()
            )
        assert fm.grad_path == "layers"


@pytest.mark.parametrize("device", DEVICES)
def test_backbone_features_run_on_the_backbone_device(device):
    from fedsgld.models.backbone import extract_features

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    x = torch.randn(5, 1, 12, 12)
    ref = backbone(F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False))
    feats = extract_features(copy.deepcopy(backbone).to(device), x, image_size=16, batch=2)
    assert feats.device == x.device and feats.shape == (5, 4)
    torch.testing.assert_close(feats, ref.detach(), rtol=1e-4, atol=1e-5)


class ScaledLinear(nn.Linear):
    """A Linear layer of its own type: the registry looks layers up by their exact type."""


def test_a_registered_layer_type_takes_the_layer_path_and_matches_the_loop():
    from fedsgld.core import grad_samplers

    torch.manual_seed(4)
    module = nn.Sequential(ScaledLinear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    assert FlatModel(module).grad_path == "func"  # not registered: torch.func
    linear = grad_samplers.GRAD_SAMPLERS[nn.Linear]
    grad_samplers.register_grad_sampler(ScaledLinear, check=linear.check)(linear.terms)
    try:
        fm = FlatModel(module)
        assert fm.grad_path == "layers"
        x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
        theta = fm.flatten()
        ref = loop_grads(fm, theta, x, y)
        torch.testing.assert_close(fm.per_record_grads(theta, x, y), ref, rtol=1e-4, atol=1e-6)
        assert fm.layers_checked
        clip = float(ref.norm(dim=1).median())
        got = clipped_gradient_sum(fm, theta, x, y, clip=clip)
        expected = (ref * (clip / ref.norm(dim=1, keepdim=True)).clamp(max=1.0)).sum(0)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    finally:
        del grad_samplers.GRAD_SAMPLERS[ScaledLinear]
