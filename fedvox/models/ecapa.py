"""Small ECAPA-TDNN extractor (Desplanques et al. 2020), laid out as WeSpeaker's ecapa_tdnn.py.

Sits between features and scoring: [batch, frames, feat_dim] features in, [batch, emb_dim] out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedvox.errors import ConfigError, DataError
from fedvox.models.xvector import frame_mask, make_norm, weighted_mean_std


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    # Zeroing padded frames before every convolution wider than 1 makes a padded utterance see
    # exactly the zero padding it would see alone, so embeddings do not depend on batch-mates.
    if mask is None:
        return x
    return x * mask


class ConvReluNorm(nn.Module):
    """Conv1d ('same' length) -> ReLU -> norm, the WeSpeaker Conv1dReluBn."""

    def __init__(
        self, in_dim: int, out_dim: int, kernel: int = 1, dilation: int = 1, norm: str = "batch"
    ) -> None:
        super().__init__()
        padding = (kernel - 1) * dilation // 2
        self.conv = nn.Conv1d(in_dim, out_dim, kernel, dilation=dilation, padding=padding)
        self.norm = make_norm(norm, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.relu(self.conv(x)))


class Res2Conv(nn.Module):
    """Res2Net multi-scale convolution: `scale` channel groups, each conv sees the previous one."""

    def __init__(self, channels: int, kernel: int, dilation: int, scale: int, norm: str) -> None:
        super().__init__()
        self.width = channels // scale
        self.convs = nn.ModuleList(
            [ConvReluNorm(self.width, self.width, kernel, dilation, norm) for _ in range(scale - 1)]
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        groups = torch.split(x, self.width, dim=1)
        out: list[Tensor] = []
        sp = groups[0]
        for i, conv in enumerate(self.convs):
            if i > 0:
                sp = sp + groups[i]
            sp = conv(_masked(sp, mask))
            out.append(sp)
        out.append(groups[len(groups) - 1])  # the last group passes through untouched
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    """Squeeze-excitation over channels from the (padding-aware) time average."""

    def __init__(self, channels: int, bottleneck: int = 128) -> None:
        super().__init__()
        self.linear1 = nn.Linear(channels, bottleneck)
        self.linear2 = nn.Linear(bottleneck, channels)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            s = x.mean(dim=2)
        else:
            s = (x * mask).sum(dim=2) / mask.sum(dim=2)
        s = torch.sigmoid(self.linear2(F.relu(self.linear1(s))))
        return x * s.unsqueeze(2)


class SERes2Block(nn.Module):
    """1x1 conv -> Res2 dilated conv -> 1x1 conv -> SE, plus the residual."""

    def __init__(self, channels: int, dilation: int, scale: int, norm: str) -> None:
        super().__init__()
        self.conv1 = ConvReluNorm(channels, channels, 1, 1, norm)
        self.res2 = Res2Conv(channels, 3, dilation, scale, norm)
        self.conv2 = ConvReluNorm(channels, channels, 1, 1, norm)
        self.se = SqueezeExcite(channels)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        out = self.conv2(self.res2(self.conv1(x), mask))
        return self.se(out, mask) + x


class AttentiveStatsPooling(nn.Module):
    """Channel- and context-dependent attentive statistics pooling (ECAPA's ASP).

    The attention sees each frame together with the utterance's global mean and std, and
    gives every channel its own weights over time; output is [weighted mean, weighted std].
    """

    def __init__(self, channels: int, bottleneck: int = 128) -> None:
        super().__init__()
        self.linear1 = nn.Conv1d(3 * channels, bottleneck, kernel_size=1)
        self.linear2 = nn.Conv1d(bottleneck, channels, kernel_size=1)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        frames = x.shape[2]
        uniform: Tensor | None = None
        if mask is not None:
            uniform = mask / mask.sum(dim=2, keepdim=True)
        mean, std = weighted_mean_std(x, uniform)
        context = torch.cat(
            [x, mean.unsqueeze(2).expand(-1, -1, frames), std.unsqueeze(2).expand(-1, -1, frames)],
            dim=1,
        )
        scores = self.linear2(torch.tanh(self.linear1(context)))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        alpha = torch.softmax(scores, dim=2)
        mean, std = weighted_mean_std(x, alpha)
        return torch.cat([mean, std], dim=1)


class ECAPATDNN(nn.Module):
    """ECAPA-TDNN: conv stem, 3 SE-Res2Net blocks (dilation 2, 3, 4; scale 8), multi-layer
    feature aggregation (1x1 conv over the 3 blocks' outputs, 3*channels wide), attentive
    statistics pooling, norm, Linear -> embedding.

    channels=256 is the small CPU size; 512 is WeSpeaker's "c512". The aggregation width is
    3*channels (WeSpeaker fixes it at 1536 for every size). `norm` has XVector's meaning and
    applies to every normalisation layer, including the one after pooling. The head is trained
    on the embedding itself (`head_input` == `forward`).
    """

    SCALE = 8
    DILATIONS = (2, 3, 4)

    def __init__(
        self, feat_dim: int = 80, channels: int = 256, emb_dim: int = 192, norm: str = "batch"
    ) -> None:
        super().__init__()
        if channels < self.SCALE or channels % self.SCALE:
            raise ConfigError(
                "model.channels",
                f"channels={channels} is not a positive multiple of the Res2Net scale {self.SCALE}",
                "use e.g. 256 or 512",
            )
        if feat_dim < 1 or emb_dim < 1:
            raise ConfigError(
                "model", f"feat_dim={feat_dim}, emb_dim={emb_dim}", "use positive sizes"
            )
        self.feat_dim = feat_dim
        self.emb_dim = emb_dim
        self.norm_kind = norm
        self.stem = ConvReluNorm(feat_dim, channels, 5, 1, norm)
        self.blocks = nn.ModuleList(
            [SERes2Block(channels, d, self.SCALE, norm) for d in self.DILATIONS]
        )
        agg = 3 * channels
        self.aggregate = nn.Conv1d(len(self.DILATIONS) * channels, agg, kernel_size=1)
        self.pool = AttentiveStatsPooling(agg)
        self.pool_norm = make_norm(norm, 2 * agg)
        self.linear = nn.Linear(2 * agg, emb_dim)

    @torch.jit.unused
    def _check(self, feats: Tensor, lengths: Tensor | None) -> None:
        if feats.dim() != 3 or feats.shape[2] != self.feat_dim:
            raise DataError(
                None,
                f"ECAPA input has shape {tuple(feats.shape)}, expected [batch, frames, {self.feat_dim}]",
                "pass time-major features with the model's feat_dim",
            )
        if feats.shape[1] < 1 or (lengths is not None and int(lengths.min()) < 1):
            raise DataError(None, "an utterance has no frames", "drop empty utterances")

    def forward(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Embeddings [B, emb_dim] of features [B, T, feat_dim]; lengths [B] marks padding."""
        if not (torch.jit.is_scripting() or torch.jit.is_tracing()):
            self._check(feats, lengths)
        x = feats.transpose(1, 2)
        mask: Tensor | None = None
        if lengths is not None:
            mask = frame_mask(lengths, x.shape[2], x.dtype)
        out = self.stem(_masked(x, mask))
        outs: list[Tensor] = []
        for block in self.blocks:
            out = block(out, mask)
            outs.append(out)
        out = F.relu(self.aggregate(torch.cat(outs, dim=1)))
        return self.linear(self.pool_norm(self.pool(out, mask)))

    def head_input(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        """What the speaker head is trained on: the embedding itself."""
        return self.forward(feats, lengths)
