"""Tests for fedvox.models: extractors, AAM head, margin ramp, training step, export.

Small widths and short inputs wherever the preset itself is not the point.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from fedvox.errors import ConfigError, DataError
from fedvox.models import (
    ECAPATDNN,
    MODEL_PRESETS,
    AAMSoftmax,
    XVector,
    build_extractor,
    count_parameters,
    margin_schedule,
    speaker_loss,
    train_step,
)
from fedvox.models.xvector import VARIANCE_FLOOR, ChannelLayerNorm, time_mean_std
from fedvox.tasks.speakers import SpeakerTask

TINY = (32, 32, 32, 32, 64)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tiny_xvector(norm: str = "layer", embedding_layer: str = "a", feat_dim: int = 30) -> XVector:
    torch.manual_seed(1)
    return XVector(feat_dim, TINY, 24, embedding_layer=embedding_layer, norm=norm)


def _tiny_ecapa(norm: str = "layer") -> ECAPATDNN:
    torch.manual_seed(1)
    return ECAPATDNN(20, channels=32, emb_dim=16, norm=norm)


# ---------------------------------------------------------------- shapes and presets


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_every_preset_gives_embeddings_for_variable_frame_counts(name):
    feat_dim = 80 if MODEL_PRESETS[name]["arch"] == "ecapa" else 30
    model = build_extractor(name, feat_dim).eval()
    emb_dim = MODEL_PRESETS[name]["emb_dim"]
    with torch.no_grad():
        for frames in (15, 37, 120):
            out = model(torch.randn(2, frames, feat_dim, generator=_gen(frames)))
            assert out.shape == (2, emb_dim)
            assert torch.isfinite(out).all()


def test_kaldi_size_xvector_parameter_count():
    # 30-dim input (Kaldi v2 MFCC): frame layers 2,683,356 + segment a 1,536,512 + segment b
    # 262,656 + BatchNorm affine 9,144 = 4,491,668 (Kaldi's BN has no affine: 4,482,524).
    model = build_extractor("xvector", 30)
    n = count_parameters(model)
    assert 4_200_000 <= n <= 4_800_000
    assert n == 4_491_668
    assert count_parameters(build_extractor("xvector", 30, norm="none")) == 4_482_524


def test_small_xvector_has_w1_shapes():
    assert build_extractor("xvector-small", 30).embedding_layer == "b"  # preset default
    model = build_extractor("xvector-small", 30, embedding_layer="a")  # W1's exact stack
    convs = [layer.conv for layer in model.frame_layers]
    assert [tuple(c.weight.shape) for c in convs] == [
        (256, 30, 5),
        (256, 256, 3),
        (256, 256, 3),
        (256, 256, 1),
        (768, 256, 1),
    ]
    assert [c.dilation[0] for c in convs] == [1, 2, 3, 1, 1]
    assert all(c.padding == (0,) for c in convs)
    assert tuple(model.segment_a.weight.shape) == (256, 1536)
    assert tuple(model.segment_b.weight.shape) == (256, 256)
    assert all(isinstance(layer.norm, nn.BatchNorm1d) for layer in model.frame_layers)
    # W1: Linear 256->256 ReLU BN before the output layer, so the head reads 256 dims.
    assert isinstance(model.norm_b, nn.BatchNorm1d)
    assert model.eval().head_input(torch.randn(3, 200, 30)).shape == (3, 256)


def test_count_parameters_ignores_buffers():
    bn = nn.BatchNorm1d(7)
    assert count_parameters(bn) == 14  # running_mean/var are buffers


def test_build_extractor_errors_and_overrides():
    with pytest.raises(ConfigError, match="unknown model 'resnet'"):
        build_extractor("resnet", 30)
    with pytest.raises(ConfigError, match=r"model\.channels"):
        build_extractor("xvector", 30, channels=8)
    with pytest.raises(ConfigError, match="unknown norm"):
        build_extractor("xvector-small", 30, norm="group")
    model = build_extractor("ecapa-small", 40, norm="layer", emb_dim=128)
    assert model.emb_dim == 128 and isinstance(model.stem.norm, ChannelLayerNorm)
    assert model(torch.randn(1, 30, 40)).shape == (1, 128)


def test_bad_input_raises_data_error():
    model = _tiny_xvector().eval()
    with pytest.raises(DataError, match="too short"):
        model(torch.randn(1, 14, 30))
    with pytest.raises(DataError, match="expected"):
        model(torch.randn(1, 50, 20))
    with pytest.raises(DataError, match="expected"):
        _tiny_ecapa()(torch.randn(50, 20))


# ---------------------------------------------------------------- embedding layer and norms


def test_embedding_layer_a_is_segment_a_and_b_is_segment_b():
    feats = torch.randn(3, 40, 30, generator=_gen())
    for layer in ("a", "b"):
        model = _tiny_xvector(embedding_layer=layer).eval()
        seen: dict[str, torch.Tensor] = {}
        for name in ("a", "b"):
            getattr(model, f"segment_{name}").register_forward_hook(
                lambda m, i, o, name=name, seen=seen: seen.__setitem__(name, o)
            )
        with torch.no_grad():
            emb = model(feats)
            top = model.head_input(feats)
        torch.testing.assert_close(emb, seen[layer])
        if layer == "a":
            # Kaldi: training continues through b -> ReLU -> norm to the head.
            torch.testing.assert_close(top, model.norm_b(F.relu(seen["b"])))
            assert not torch.allclose(top, emb)
        else:
            torch.testing.assert_close(top, emb)  # WeSpeaker: head reads the embedding


@pytest.mark.parametrize("norm", ["batch", "layer", "none"])
def test_norm_variants_build_and_train(norm):
    expected = {"batch": nn.BatchNorm1d, "layer": ChannelLayerNorm, "none": nn.Identity}[norm]
    for model in (_tiny_xvector(norm=norm), _tiny_ecapa(norm=norm)):
        norms = [m for m in model.modules() if isinstance(m, expected)]
        assert len(norms) >= 5
        feats = torch.randn(4, 30, model.feat_dim, generator=_gen())
        model.train()
        model.head_input(feats).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("make", [_tiny_xvector, _tiny_ecapa])
def test_layer_norm_eval_is_deterministic_and_batch_independent(make):
    # float64, so that "independent" can be checked tightly: in float32 the convolution kernels
    # chosen for different batch sizes round differently (~1e-5, amplified by normalisation).
    model = make("layer").eval().double()
    feats = torch.randn(5, 45, model.feat_dim, generator=_gen(3), dtype=torch.float64)
    mates = torch.randn(3, 45, model.feat_dim, generator=_gen(4), dtype=torch.float64)
    with torch.no_grad():
        together = model(feats)
        again = model(feats)
        alone = torch.cat([model(feats[i : i + 1]) for i in range(5)])
        other_mates = model(torch.cat([feats[2:3], mates]))[0]
        assert torch.equal(together, again)
        torch.testing.assert_close(together, alone, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(together[2], other_mates, atol=1e-10, rtol=1e-10)
        # Layer norm is batch-independent in training mode too; BatchNorm is not.
        model.train()
        torch.testing.assert_close(model(feats)[:1], model(feats[:1]), atol=1e-10, rtol=1e-10)
        bn = make("batch").train().double()
        assert not torch.allclose(bn(feats)[:2], bn(feats[:2]), atol=1e-3)


@pytest.mark.parametrize("make", [_tiny_xvector, _tiny_ecapa])
@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_padded_batch_with_lengths_matches_each_utterance_alone(make, norm):
    model = make(norm).eval().double()
    lengths = [50, 23, 37]
    utts = [torch.randn(n, model.feat_dim, generator=_gen(n), dtype=torch.float64) for n in lengths]
    padded = torch.zeros(3, 50, model.feat_dim, dtype=torch.float64)
    for i, u in enumerate(utts):
        padded[i, : len(u)] = u
    padded[1, 23:] = 7.0  # garbage in the padding must not leak in
    with torch.no_grad():
        batched = model(padded, torch.tensor(lengths))
        alone = torch.cat([model(u.unsqueeze(0)) for u in utts])
        unmasked = model(padded)
    torch.testing.assert_close(batched, alone, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(unmasked[1], alone[1], atol=1e-3)  # the mask is what does it


def test_std_pooling_is_safe_on_constant_channels():
    # With norm "none" and a ReLU, constant (zero-variance) channels are common; the variance
    # floor must keep the gradient finite.
    model = _tiny_xvector(norm="none")
    with torch.no_grad():
        model.frame_layers[4].conv.bias.fill_(-100.0)  # every frame-5 channel dead: var == 0
    model(torch.randn(2, 30, 30)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _spelled_out_mean_std(x: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(dim=1)
    centred = x - mean.unsqueeze(1)
    return mean, (centred * centred).mean(dim=1).clamp(min=floor).sqrt()


def test_fused_pooling_backward_equals_autograd_of_the_spelled_out_form():
    torch.manual_seed(0)
    x = torch.randn(3, 20, 6, dtype=torch.float64)
    x[1, :, 2] = 0.5  # a constant channel: floored variance, no gradient through its std
    x.requires_grad_(True)
    g_mean, g_std = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    fused = time_mean_std(x, None)
    ref = _spelled_out_mean_std(x, VARIANCE_FLOOR)
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    got = torch.autograd.grad(fused, x, (g_mean, g_std))[0]
    want = torch.autograd.grad(ref, x, (g_mean, g_std))[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.all(got[1, :, 2] == g_mean[1, 2] / 20)  # only the mean's share reaches it
    assert torch.autograd.gradcheck(
        lambda t: time_mean_std(t, None), (x.detach()[:1].clone().requires_grad_(),)
    )
    # under vmap(grad) over clients, as the engine runs it
    xs = torch.randn(4, 2, 20, 6)

    def total(f):
        return lambda t: sum(v.sum() for v in f(t))

    per_client = torch.stack(
        [grad(total(lambda t: _spelled_out_mean_std(t, VARIANCE_FLOOR)))(t) for t in xs]
    )
    torch.testing.assert_close(vmap(grad(total(lambda t: time_mean_std(t, None))))(xs), per_client)


# ---------------------------------------------------------------- AAM softmax


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def test_aam_without_margin_is_scaled_cosine():
    head = AAMSoftmax(8, 5, scale=30.0, margin=0.0)
    emb = torch.randn(6, 8, generator=_gen())
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    expected = 30.0 * _unit(emb) @ _unit(head.weight).T
    torch.testing.assert_close(head(emb, labels), expected)
    head.set_margin(0.3)
    torch.testing.assert_close(head(emb), expected)  # no labels: inference logits


def test_aam_target_logit_is_cos_theta_plus_m():
    m, s = 0.25, 32.0
    head = AAMSoftmax(8, 5, scale=s, margin=m)
    emb = torch.randn(40, 8, generator=_gen(5))
    labels = torch.randint(0, 5, (40,), generator=_gen(6))
    cos = (_unit(emb) @ _unit(head.weight).T).double()
    theta = torch.acos(cos.clamp(-1, 1))
    target = torch.nn.functional.one_hot(labels, 5).bool()
    logits = head(emb, labels).double()
    regular = target & (theta + m < math.pi)
    assert regular.sum() >= 30
    torch.testing.assert_close(
        logits[regular], s * torch.cos(theta[regular] + m), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(logits[~target], s * cos[~target], atol=1e-4, rtol=0)


def test_aam_fallback_past_pi_is_continuous_and_monotone():
    m, s = 0.2, 30.0
    head = AAMSoftmax(2, 1, scale=s, margin=m)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0]]))
    # Angles swept across the threshold pi - m up to pi.
    theta = torch.linspace(math.pi - 2 * m, math.pi, 401, dtype=torch.float64)
    emb = torch.stack([torch.cos(theta), torch.sin(theta)], dim=1).float()
    logits = head(emb, torch.zeros(401, dtype=torch.long))[:, 0].double()
    past = theta >= math.pi - m + 1e-3
    expected = s * (torch.cos(theta[past]) - 1.0 - math.cos(math.pi - m))
    torch.testing.assert_close(logits[past], expected, atol=1e-3, rtol=0)
    assert (logits.diff() <= 1e-3).all()  # decreasing in theta, no jump at the threshold
    assert logits.diff().abs().max() < 0.05


def test_aam_gradient_flows_and_is_finite_at_aligned_vectors():
    head = AAMSoftmax(8, 4, margin=0.2)
    emb = torch.randn(4, 8, generator=_gen(2))
    with torch.no_grad():
        emb[0] = head.weight[1] * 3.0  # cos == 1 exactly for its own class
    emb.requires_grad_(True)
    labels = torch.tensor([1, 0, 2, 3])
    F.cross_entropy(head(emb, labels), labels).backward()
    assert torch.isfinite(emb.grad).all() and emb.grad[1:].abs().sum() > 0
    assert torch.isfinite(head.weight.grad).all() and head.weight.grad.abs().sum() > 0


def test_aam_margin_validation():
    with pytest.raises(ConfigError):
        AAMSoftmax(8, 4, margin=-0.1)
    with pytest.raises(ConfigError):
        AAMSoftmax(8, 4).set_margin(2.0)


def test_margin_schedule_ramp():
    sched = [margin_schedule(p) for p in (0.0, 0.1, 0.2, 0.35, 0.5, 0.8, 1.0)]
    assert sched == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.2, 0.2, 0.2])
    assert margin_schedule(0.25, 0.3, 0.0, 0.5) == pytest.approx(0.15)
    assert margin_schedule(0.5, 0.2, 0.5, 0.5) == pytest.approx(0.2)  # step at a zero ramp
    with pytest.raises(ConfigError):
        margin_schedule(0.5, ramp_start=0.6, ramp_end=0.4)


# ---------------------------------------------------------------- training step


def _speaker_batch(gen: torch.Generator, mu: torch.Tensor, n: int, frames: int = 40):
    labels = torch.randint(0, mu.shape[0], (n,), generator=gen)
    feats = 0.5 * mu[labels].unsqueeze(1) + torch.randn(n, frames, mu.shape[1], generator=gen)
    return feats, labels


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_train_step_learns_four_speakers(norm):
    gen = _gen(11)
    mu = torch.randn(4, 30, generator=gen)
    torch.manual_seed(0)
    ext = XVector(30, TINY, 32, norm=norm)
    head = AAMSoftmax(32, 4, margin=0.2)
    opt = torch.optim.SGD([*ext.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    ext.eval()
    test_feats, test_labels = _speaker_batch(gen, mu, 64)
    with torch.no_grad():
        before = (head.cosine(ext.head_input(test_feats)).argmax(1) == test_labels).float().mean()
    ext.train()
    losses = [
        train_step(ext, head, opt, *_speaker_batch(gen, mu, 16), max_grad_norm=5.0)
        for _ in range(40)
    ]
    assert sum(losses[-5:]) / 5 < 0.2 * losses[0]
    ext.eval()
    with torch.no_grad():
        after = (head.cosine(ext.head_input(test_feats)).argmax(1) == test_labels).float().mean()
    assert after >= 0.95 and after > before


def test_train_step_clips_the_global_gradient_norm():
    ext, head = _tiny_xvector(), AAMSoftmax(24, 3)
    opt = torch.optim.SGD([*ext.parameters(), *head.parameters()], lr=0.0)
    feats, labels = torch.randn(4, 30, 30) * 50, torch.tensor([0, 1, 2, 0])
    loss = train_step(ext, head, opt, feats, labels, max_grad_norm=0.01)
    assert isinstance(loss, float) and loss > 0
    grads = [p.grad for m in (ext, head) for p in m.parameters()]
    assert torch.norm(torch.stack([g.norm() for g in grads])) <= 0.01 + 1e-6


def _mean_loss(task: SpeakerTask):
    """The speaker task's per-example losses as the mean speaker_loss, a pure function."""
    return lambda p, x, y: task.loss(p, {"x": x, "y": y}).mean()


def test_task_loss_is_the_per_example_speaker_loss():
    ext, head = _tiny_ecapa(), AAMSoftmax(16, 3)
    task = SpeakerTask(ext, head)
    feats, labels = torch.randn(4, 30, 20), torch.tensor([0, 1, 2, 1])
    params = task.init_params()
    assert all(k.startswith(("extractor.", "head.")) for k in params)
    per_example = task.loss(params, {"x": feats, "y": labels})
    assert per_example.shape == (4,)
    torch.testing.assert_close(per_example.mean(), speaker_loss(ext, head, feats, labels))
    zeroed = {k: torch.zeros_like(v) if k == "head.weight" else v for k, v in params.items()}
    f = _mean_loss(task)
    assert not torch.allclose(f(zeroed, feats, labels), speaker_loss(ext, head, feats, labels))


@pytest.mark.parametrize("embedding_layer", ["a", "b"])
def test_vmapped_grad_over_clients_equals_per_client_loop(embedding_layer):
    n_clients, batch, frames = 3, 4, 32
    ext = _tiny_xvector(norm="layer", embedding_layer=embedding_layer)
    head = AAMSoftmax(24, 6, margin=0.2)
    task = SpeakerTask(ext, head)
    base = task.init_params()
    gen = _gen(21)
    stacked = {
        k: torch.stack(
            [v + 0.05 * c * torch.randn(v.shape, generator=gen) for c in range(n_clients)]
        )
        for k, v in base.items()
    }
    feats = torch.randn(n_clients, batch, frames, 30, generator=gen)
    labels = torch.randint(0, 6, (n_clients, batch), generator=gen)

    per_client = vmap(grad(_mean_loss(task)))(stacked, feats, labels)

    for c in range(n_clients):
        # Independent oracle: a fresh module pair loaded with client c's tensors, eager autograd.
        ext_c = XVector(30, TINY, 24, embedding_layer=embedding_layer, norm="layer")
        head_c = AAMSoftmax(24, 6, margin=0.2)
        ext_c.load_state_dict(
            {k[len("extractor.") :]: v[c] for k, v in stacked.items() if k.startswith("extractor.")}
        )
        head_c.load_state_dict({"weight": stacked["head.weight"][c]})
        speaker_loss(ext_c, head_c, feats[c], labels[c]).backward()
        expected = {f"extractor.{k}": p.grad for k, p in ext_c.named_parameters()}
        expected["head.weight"] = head_c.weight.grad
        assert expected.keys() == per_client.keys()
        for k, g in expected.items():
            torch.testing.assert_close(per_client[k][c], g, atol=1e-5, rtol=1e-4, msg=k)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("make", [_tiny_xvector, _tiny_ecapa])
def test_torchscript_script_handles_other_lengths_and_round_trips(make, tmp_path):
    model = make("batch").eval()
    scripted = torch.jit.script(model)
    path = tmp_path / "extractor.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    for frames in (20, 61):
        feats = torch.randn(2, frames, model.feat_dim, generator=_gen(frames))
        with torch.no_grad():
            eager = model(feats)
            torch.testing.assert_close(scripted(feats), eager)
            torch.testing.assert_close(loaded(feats), eager)
            lengths = torch.tensor([frames, 17])
            torch.testing.assert_close(loaded(feats, lengths), model(feats, lengths))


def test_torchscript_trace_does_not_bake_in_the_length():
    model = _tiny_xvector("batch").eval()
    traced = torch.jit.trace(model, (torch.randn(2, 40, 30),))
    feats = torch.randn(3, 77, 30)
    with torch.no_grad():
        torch.testing.assert_close(traced(feats), model(feats))


def test_onnx_export_matches_eager(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    model = _tiny_xvector("batch").eval()
    path = tmp_path / "xvector.onnx"
    # The default (dynamo) exporter needs onnxscript, which fedvox does not depend on; the
    # TorchScript-based exporter needs only torch.
    try:
        torch.onnx.export(
            model,
            (torch.randn(1, 40, 30),),
            str(path),
            dynamo=False,
            input_names=["feats"],
            output_names=["embedding"],
            dynamic_axes={"feats": {0: "batch", 1: "frames"}},
        )
    except (ImportError, RuntimeError) as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"ONNX export unavailable: {err}")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    feats = torch.randn(2, 63, 30)
    (out,) = ReferenceEvaluator(proto).run(None, {"feats": feats.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(feats), atol=1e-5, rtol=1e-4)


def test_saved_model_loads_back_to_the_same_weights_and_outputs(tmp_path) -> None:
    from fedvox.models.io import load_model, save_model, weights_hash

    torch.manual_seed(0)
    model = build_extractor("xvector-small", 20, norm="layer", embedding_layer="a")
    model.eval()
    path = save_model(
        tmp_path / "m.pt",
        model,
        model_name="xvector-small",
        feat_dim=20,
        norm="layer",
        embedding_layer="a",
    )
    loaded = load_model(path)
    assert not loaded.training
    assert weights_hash(loaded) == weights_hash(model)
    x = torch.randn(2, 40, 20)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_load_model_of_a_missing_file_names_it_and_the_fix(tmp_path) -> None:
    from fedvox.models.io import load_model

    with pytest.raises(DataError, match=r"missing\.pt: no trained model here\. Fix: pass"):
        load_model(tmp_path / "missing.pt")
