"""x-vector TDNN extractor (Snyder et al. 2018, Kaldi voxceleb/v2) and the layers it shares.

Sits between features and scoring: [batch, frames, feat_dim] features in, [batch, emb_dim] out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedvox.errors import ConfigError, DataError

NORMS = ("batch", "layer", "none")
EMBEDDING_LAYERS = ("a", "b")

# Floor on pooled variances before the square root. ReLU leaves whole channels constant
# (variance exactly 0), where d sqrt(v)/dv is infinite; clamping gives a zero gradient there
# and bounds it by 0.5/sqrt(1e-5) ~ 158 elsewhere. Kaldi's stats pooling floors variance too.
VARIANCE_FLOOR = 1e-5


class ChannelLayerNorm(nn.Module):
    """LayerNorm over channels, per frame ([B, C, T]) or per vector ([B, C]).

    Batch- and length-independent, so it behaves the same for a client of 2 utterances as for
    a batch of 256, and it has no running statistics for torch.func.vmap to trip over.
    """

    def __init__(self, channels: int, time_major: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.time_major = time_major  # input [B, T, C]: channels are already the last axis

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3 and not self.time_major:
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(x)


def make_norm(norm: str, channels: int, time_major: bool = False) -> nn.Module:
    """The normalisation layer for `norm` in NORMS, over `channels` ([B, C, T] or [B, C];
    [B, T, C] when `time_major`, which BatchNorm1d does not support)."""
    if norm == "batch":
        if time_major:
            raise ValueError("BatchNorm1d layers are channel-major")
        return nn.BatchNorm1d(channels)
    if norm == "layer":
        return ChannelLayerNorm(channels, time_major)
    if norm == "none":
        return nn.Identity()
    raise ConfigError("model.norm", f"unknown norm '{norm}'", "use one of: " + ", ".join(NORMS))


def frame_mask(lengths: Tensor, frames: int, dtype: torch.dtype) -> Tensor:
    """[B, 1, frames] mask, 1 for frame t < lengths[b] and 0 for padding."""
    steps = torch.arange(frames, device=lengths.device)
    return (steps.unsqueeze(0) < lengths.unsqueeze(1)).to(dtype).unsqueeze(1)


def weighted_mean_std(
    x: Tensor, weights: Tensor | None, floor: float = VARIANCE_FLOOR
) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation of x [B, C, T] over time with weights summing to 1 over T.

    weights is [B, 1, T] (a padding mask normalised per utterance) or [B, C, T] (attention);
    None means uniform. The variance is computed centred (not E[x^2] - mean^2, which cancels
    catastrophically in float32) and floored at `floor`.
    """
    if weights is None:
        # Fused op: about half the time of the spelled-out form, forward plus backward.
        var, mean = torch.var_mean(x, dim=2, correction=0)
    else:
        mean = (x * weights).sum(dim=2)
        centred = x - mean.unsqueeze(2)
        var = (centred * centred * weights).sum(dim=2)
    return mean, var.clamp(min=floor).sqrt()


def time_mean_std(
    x: Tensor, lengths: Tensor | None, floor: float = VARIANCE_FLOOR
) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation over time of time-major x [B, T, C] (valid frames only
    when `lengths` [B] is given); centred variance floored at `floor`, as weighted_mean_std.

    Spelled out rather than torch.var_mean: over a non-inner dimension var_mean's kernel took
    about 35 ms per call on W1's shapes, five times this form (forward plus backward).
    """
    if lengths is None and not (torch.jit.is_scripting() or torch.jit.is_tracing()):
        return _MeanStdPool.apply(x, floor)  # the same values, a cheaper backward
    if lengths is None:
        mean = x.mean(dim=1)
        centred = x - mean.unsqueeze(1)
        var = (centred * centred).mean(dim=1)
    else:
        w = frame_mask(lengths, x.shape[1], x.dtype).transpose(1, 2)  # [B, T, 1]
        w = w / w.sum(dim=1, keepdim=True)
        mean = (x * w).sum(dim=1)
        centred = x - mean.unsqueeze(1)
        var = (centred * centred * w).sum(dim=1)
    return mean, var.clamp(min=floor).sqrt()


class _MeanStdPool(torch.autograd.Function):
    """Mean and floored std over time of [B, T, C], with a one-pass backward.

    dx = g_mean / T + (x − mean) · g_std / (T · std), and 0 through std where the variance was
    floored. Autograd's spelled-out form walks the [B, T, C] activation about eight times in
    backward (mul, neg, sum, div, add, ...); this walks it once (addcmul). Pure torch ops, so
    vmap over clients derives its batching rule.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, floor: float) -> tuple[Tensor, Tensor]:
        mean = x.mean(dim=1)
        centred = x - mean.unsqueeze(1)
        var = (centred * centred).mean(dim=1)
        return mean, var.clamp(min=floor).sqrt()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, floor = inputs
        mean, std = output
        ctx.floor = floor
        ctx.save_for_backward(x, mean, std)

    @staticmethod
    def backward(ctx, g_mean: Tensor, g_std: Tensor) -> tuple[Tensor, None]:
        x, mean, std = ctx.saved_tensors
        frames = x.shape[1]
        # std == sqrt(floor) exactly where the clamp was active: no gradient through it there
        active = std > torch.tensor(ctx.floor, dtype=std.dtype).sqrt()
        coef = torch.where(active, g_std / (std * frames), torch.zeros_like(std))
        base = (g_mean / frames).unsqueeze(1) - (coef * mean).unsqueeze(1)
        return torch.addcmul(base, x, coef.unsqueeze(1)), None


class TdnnLayer(nn.Module):
    """One frame-level TDNN layer: dilated Conv1d (the context) -> ReLU -> norm.

    Channel-major [B, C, T] through Conv1d (needed by BatchNorm), or, with `time_major`, the
    same function on [B, T, C] as Kaldi's splicing computes it: the k dilated frames
    concatenated, then one matmul with the conv weight laid out as [out, k·in].
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        kernel: int,
        dilation: int,
        norm: str,
        time_major: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_dim, out_dim, kernel_size=kernel, dilation=dilation)
        self.norm = make_norm(norm, out_dim, time_major)
        self.kernel = kernel
        self.dilation = dilation
        self.time_major = time_major

    def forward(self, x: Tensor) -> Tensor:
        if not self.time_major:
            return self.norm(F.relu(self.conv(x)))
        w = self.conv.weight  # [out, in, k]
        if self.kernel == 1:
            y = F.linear(x, w[:, :, 0], self.conv.bias)
        else:
            frames = x.shape[1] - (self.kernel - 1) * self.dilation
            spliced = torch.cat(
                [x[:, j * self.dilation : j * self.dilation + frames] for j in range(self.kernel)],
                dim=2,
            )
            weight = w.permute(0, 2, 1).reshape(w.shape[0], -1)
            y = F.linear(spliced, weight, self.conv.bias)
        return self.norm(F.relu(y))


class XVector(nn.Module):
    """Kaldi x-vector TDNN: 5 frame layers, mean+std pooling, segment layers a and b.

    Contexts {-2..2}, {-2,0,2}, {-3,0,3}, {0}, {0} as unpadded Conv1d (kernel 5/3/3/1/1,
    dilation 1/2/3/1/1), so 14 frames are consumed and an utterance needs at least 15.

    Which output is the embedding (`embedding_layer`):
      "a" (Kaldi): the embedding is segment layer a's affine output; training goes on through
          ReLU -> norm -> segment b -> ReLU -> norm, which `head_input` returns for the head.
      "b" (WeSpeaker): the embedding is segment layer b's affine output and the head is
          trained on the embedding itself (`head_input` == `forward`), so the head's class
          vectors live in the embedding space (what speaker prototypes built from enrollment
          embeddings need).
    Norm: "batch" (Kaldi-faithful BatchNorm1d), "layer" (ChannelLayerNorm: batch-independent,
    vmap-safe, for federated/vectorised clients), "none".
    """

    KERNELS = (5, 3, 3, 1, 1)
    DILATIONS = (1, 2, 3, 1, 1)

    def __init__(
        self,
        feat_dim: int = 30,
        widths: Sequence[int] = (512, 512, 512, 512, 1500),
        emb_dim: int = 512,
        embedding_layer: str = "a",
        norm: str = "batch",
    ) -> None:
        super().__init__()
        widths = tuple(int(w) for w in widths)
        if len(widths) != 5 or min(widths) < 1:
            raise ConfigError(
                "model.widths",
                f"need 5 positive layer widths, got {widths}",
                "e.g. [512, 512, 512, 512, 1500]",
            )
        if embedding_layer not in EMBEDDING_LAYERS:
            raise ConfigError(
                "model.embedding_layer",
                f"unknown embedding layer '{embedding_layer}'",
                "use 'a' (Kaldi) or 'b' (WeSpeaker)",
            )
        if feat_dim < 1 or emb_dim < 1:
            raise ConfigError(
                "model", f"feat_dim={feat_dim}, emb_dim={emb_dim}", "use positive sizes"
            )
        self.feat_dim = feat_dim
        self.emb_dim = emb_dim
        self.embedding_layer = embedding_layer
        self.norm_kind = norm
        self._embed_at_a = embedding_layer == "a"
        # LayerNorm / no norm run time-major (spliced matmuls, norm over the inner axis): no
        # strided transposes around every norm, about 1.3-1.5x faster on W1's shapes. BatchNorm
        # keeps Conv1d's channel-major layout, so Kaldi-faithful models compute as before.
        self._time_major = norm != "batch"
        # Frames consumed by the unpadded frame layers: sum of (kernel - 1) * dilation.
        self.context = sum((k - 1) * d for k, d in zip(self.KERNELS, self.DILATIONS, strict=True))

        layers = []
        in_dim = feat_dim
        for width, kernel, dilation in zip(widths, self.KERNELS, self.DILATIONS, strict=True):
            layers.append(TdnnLayer(in_dim, width, kernel, dilation, norm, self._time_major))
            in_dim = width
        self.frame_layers = nn.Sequential(*layers)
        self.segment_a = nn.Linear(2 * widths[-1], emb_dim)
        self.norm_a = make_norm(norm, emb_dim)
        self.segment_b = nn.Linear(emb_dim, emb_dim)
        # Kaldi's tdnn7 is ReLU -> norm before the output layer; with embedding at b the head
        # reads b's affine output directly (WeSpeaker), so there is nothing after b.
        self.norm_b = make_norm(norm, emb_dim) if self._embed_at_a else nn.Identity()

    @torch.jit.unused
    def _check(self, feats: Tensor, lengths: Tensor | None) -> None:
        if feats.dim() != 3 or feats.shape[2] != self.feat_dim:
            raise DataError(
                None,
                f"x-vector input has shape {tuple(feats.shape)}, expected [batch, frames, {self.feat_dim}]",
                "pass time-major features with the model's feat_dim",
            )
        shortest = feats.shape[1] if lengths is None else int(lengths.min())
        if shortest <= self.context:
            raise DataError(
                None,
                f"utterance of {shortest} frames is too short for the x-vector "
                f"(its layers consume {self.context} frames)",
                f"use at least {self.context + 1} frames",
            )
        if lengths is not None and int(lengths.max()) > feats.shape[1]:
            raise DataError(None, "a length exceeds the padded frame count", "check lengths")

    def _segment_a(self, feats: Tensor, lengths: Tensor | None) -> Tensor:
        if not (torch.jit.is_scripting() or torch.jit.is_tracing()):
            self._check(feats, lengths)
        if self._time_major:
            h = self.frame_layers(feats)
            valid = None if lengths is None else lengths - self.context
            mean, std = time_mean_std(h, valid)
            return self.segment_a(torch.cat([mean, std], dim=1))
        x = self.frame_layers(feats.transpose(1, 2))
        weights: Tensor | None = None
        if lengths is not None:
            # Unpadded convolutions: output frame t sees input t..t+context, so an utterance of
            # n frames has exactly n - context valid outputs, unaffected by padding.
            mask = frame_mask(lengths - self.context, x.shape[2], x.dtype)
            weights = mask / mask.sum(dim=2, keepdim=True)
        mean, std = weighted_mean_std(x, weights)
        return self.segment_a(torch.cat([mean, std], dim=1))

    def forward(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Embeddings [B, emb_dim] of features [B, T, feat_dim]; lengths [B] marks padding."""
        a = self._segment_a(feats, lengths)
        if self._embed_at_a:
            return a
        return self.segment_b(self.norm_a(F.relu(a)))

    def head_input(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        """What the speaker head is trained on: the top of the network (see class docstring)."""
        b = self.segment_b(self.norm_a(F.relu(self._segment_a(feats, lengths))))
        if self._embed_at_a:
            return self.norm_b(F.relu(b))
        return b
