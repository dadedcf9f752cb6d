"""Causal depthwise convolutions over packed sequences, with the window carried between passes.

A packed pass concatenates sequences; a causal convolution of kernel ``K`` and dilation ``d`` reads the
``S = (K - 1) * d`` inputs before each token, which must come from the token's own sequence: the
previous pass's last ``S`` inputs while decoding, zeros for a sequence that starts in this pass. We
prefix every sequence with its ``S``-row history and run one valid convolution over the result; no
window can then reach into another sequence (spec §1.5: never let the kernel cross a document).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_with_history(
    x: torch.Tensor, seq_lens: list[int], history: torch.Tensor | None, span: int, fill: float = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix each sequence of ``x`` ``[T, ...]`` with its ``span`` rows of ``history`` ``[N, span, ...]``
    (``fill`` where ``None``).

    Returns the extended rows ``[T + N·span, ...]``, the index of every token in them ``[T]``, and the
    index of each sequence's last ``span`` rows ``[N, span]`` (the history of the next pass).
    """
    n = len(seq_lens)
    device = x.device
    if history is not None and span and n == x.shape[0] and all(length == 1 for length in seq_lens):
        # one token per sequence (a decode step): each sequence's rows are its history, then the
        # token; built without host data, so the step can be captured in a CUDA graph
        ext = torch.cat([history.to(x.dtype), x[:, None]], 1).reshape(n * (span + 1), *x.shape[1:])
        token_index = torch.arange(n, device=device) * (span + 1) + span
        return ext, token_index, token_index[:, None] - span + 1 + torch.arange(span, device=device)
    lens = torch.tensor(seq_lens, device=device)
    seq = torch.repeat_interleave(torch.arange(n, device=device), lens)
    token_index = torch.arange(x.shape[0], device=device) + (seq + 1) * span
    ext = x.new_full((x.shape[0] + n * span, *x.shape[1:]), fill)
    ext = ext.index_copy(0, token_index, x)
    starts = torch.cumsum(lens, 0) - lens + torch.arange(n, device=device) * span  # first history row
    window = torch.arange(span, device=device)
    if history is not None and span:
        rows = (starts[:, None] + window).reshape(-1)
        ext = ext.index_copy(0, rows, history.reshape(n * span, *x.shape[1:]).to(x.dtype))
    ends = starts + span + lens
    return ext, token_index, ends[:, None] - span + window


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: list[int],
    history: torch.Tensor | None = None,
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of packed ``x`` ``[T, C]`` with ``weight`` ``[C, K]``, computed in
    ``weight``'s dtype (as transformers does).

    ``history`` ``[N, (K-1)·dilation, C]`` holds each sequence's inputs before this pass (``None``:
    all sequences start here). Returns the output ``[T, C]`` and the history for the next pass.
    """
    kernel = weight.shape[-1]
    span = (kernel - 1) * dilation
    ext, token_index, last = extend_with_history(x.to(weight.dtype), seq_lens, history, span)
    if ext.is_cuda or ext.dtype == torch.float32:
        # transformers' arithmetic (its reference convolution is this call)
        y = F.conv1d(ext.t()[None], weight[:, None, :], dilation=dilation, groups=weight.shape[0])[0].t()
    else:
        # a depthwise F.conv1d in bf16/fp64 is 6-40x slower on CPU; tap j reads (K-1-j)·dilation rows back
        rows = ext.shape[0] - span
        y = sum(ext[j * dilation : j * dilation + rows] * weight[:, j] for j in range(kernel))
    # output row i ends its window at extended row i + span
    return y[token_index - span], ext[last]
