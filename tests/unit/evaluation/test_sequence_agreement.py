from vllm_kvevict.evaluation.sequence_agreement import (
    common_prefix_length,
    longest_common_subsequence,
    rouge_l_f1,
)


def test_common_prefix_stops_at_the_first_difference() -> None:
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([5], [1]) == 0


def test_lcs_of_a_hand_computed_case() -> None:
    # A B C B D A B vs B D C A B A: an LCS is B C B A (length 4), the textbook example.
    a, b, c, d = 1, 2, 3, 4
    assert longest_common_subsequence([a, b, c, b, d, a, b], [b, d, c, a, b, a]) == 4
    assert longest_common_subsequence([], [1, 2]) == 0


def test_rouge_l_is_the_f1_of_lcs_precision_and_recall() -> None:
    # LCS([1,2,3,4,5], [1,3,5,7]) = 3: precision 3/5, recall 3/4, F1 = 2*0.6*0.75/1.35 = 2/3.
    assert abs(rouge_l_f1([1, 2, 3, 4, 5], [1, 3, 5, 7]) - 2 / 3) < 1e-12
    assert rouge_l_f1([7, 8, 9], [7, 8, 9]) == 1.0
    assert rouge_l_f1([1, 2], [3, 4]) == 0.0
    assert rouge_l_f1([], [1]) == 0.0
