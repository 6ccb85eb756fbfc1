"""FastKVzip's per-chunk rule from the known prompt length: a trailing window is never evicted early.

vLLM knows a prompt's length L when the request arrives. With a final budget B per KV head and a trailing
window w, the tokens before the window (``L - w`` of them) are held at the ratio r' = (B - w) / (L - w) while
they arrive, and every arrived token of the window is held whole, so the prompt ends at exactly B entries
per head with its last w tokens (the question, when it comes last) never judged before they are all there.
Both the scheduler's block accounting (``accounting.RequestPlan``) and the worker's selection read it here.
"""

from __future__ import annotations

from vllm_kvevict.policies.base import check_int


def trailing_window_ratio(budget: int, prompt_len: int, window: int) -> float:
    """FastKVzip's per-chunk kept ratio r' = (B - w) / (L - w): the tokens before the prompt's trailing
    ``window`` are kept at r' so that, with the window kept whole, the prompt ends at ``budget`` = r * L
    entries per head. A window larger than the budget is cut to the budget (r' = 0)."""
    check_int("trailing_window", "budget", budget, 0)
    check_int("trailing_window", "prompt_len", prompt_len, 1)
    check_int("trailing_window", "window", window, 0)
    budget = min(budget, prompt_len)
    window = min(window, budget)
    if window >= prompt_len:
        return 1.0
    return (budget - window) / (prompt_len - window)


def trailing_window_held(
    computed: int, prompt_len: int, budget: int, window: int, floor: int = 0
) -> tuple[int, int]:
    """(entries each head holds after ``computed`` of ``prompt_len`` tokens, how many of them are the
    protected trailing window): the tokens before the window ``L - w`` are compressed to ``floor(r' * m)``
    of the m arrived so far (at least ``floor`` of them: what the scorer always keeps), and every token of
    the trailing window that has arrived is held."""
    check_int("trailing_window", "computed", computed, 0)
    ratio = trailing_window_ratio(budget, prompt_len, window)
    window = min(window, min(budget, prompt_len))
    start = prompt_len - window  # the first protected position
    before = min(computed, start)
    compressed = min(before, max(int(ratio * before), floor))
    protected = max(0, min(computed, prompt_len) - start)
    return compressed + protected, protected
