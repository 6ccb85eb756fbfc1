"""How far two token sequences agree: tokens identical before the first divergence, and ROUGE-L.

Used to compare a capped request's greedy output with the full cache's (``benchmarks/decode_quality``).
ROUGE-L here is the F1 of the longest common subsequence over token ids (Lin, 2004, with beta = 1):
precision LCS/len(candidate), recall LCS/len(reference).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(candidate: Sequence[int], reference: Sequence[int]) -> int:
    """Tokens identical from the start, before the first position where the two differ."""
    length = 0
    for a, b in zip(candidate, reference, strict=False):
        if a != b:
            break
        length += 1
    return length


def longest_common_subsequence(candidate: Sequence[int], reference: Sequence[int]) -> int:
    """Length of the LCS (dynamic programming over one row, O(len(candidate) * len(reference)))."""
    if not candidate or not reference:
        return 0
    previous = [0] * (len(reference) + 1)
    for a in candidate:
        current = [0]
        for j, b in enumerate(reference, start=1):
            current.append(previous[j - 1] + 1 if a == b else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l_f1(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 of ``candidate`` against ``reference`` (1.0 when identical, 0.0 when either is empty)."""
    lcs = longest_common_subsequence(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)
