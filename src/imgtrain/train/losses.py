"""Losses of the `loss` group beyond torch's own (conf/loss/ce.yaml is torch.nn.CrossEntropyLoss itself). Each takes
(logits [B, C], targets): class indices [B], or probabilities [B, C] (mixup/cutmix's mixed labels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FocalLoss(nn.Module):
    """Focal loss (Lin et al., 2017) on the softmax: cross-entropy with each class term weighted by (1 - p)^gamma, so
    examples the model already gets right count less. With soft targets t (or label smoothing) it is
    -sum_c t_c (1 - p_c)^gamma log p_c, which is torch's cross-entropy at gamma=0. In float32 whatever the autocast
    precision, as torch's cross-entropy is."""

    def __init__(self, gamma: float = 2.0, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.gamma, self.label_smoothing = gamma, label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=1)  # [B, C]
        classes = logits.shape[1]
        if targets.ndim == 1:  # class indices: one-hot (num_classes given: no sync on CUDA)
            targets = F.one_hot(targets, classes).float()
        if self.label_smoothing:  # as torch's cross-entropy smooths: towards the uniform distribution
            targets = targets * (1.0 - self.label_smoothing) + self.label_smoothing / classes
        weight = (1.0 - log_p.exp()).pow(self.gamma)  # (1 - p)^0 = 1: cross-entropy
        return -(targets * weight * log_p).sum(dim=1).mean()
