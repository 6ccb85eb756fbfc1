import pytest

from vllm_kvevict.policies.method_spec import parse_method_spec


def test_values_are_json_where_they_parse_and_strings_elsewhere() -> None:
    assert parse_method_spec("snapkv:window=64,pooling=avg,span_after=0") == (
        "snapkv",
        {"window": 64, "pooling": "avg", "span_after": 0},
    )
    assert parse_method_spec("roco:std_ratio=0.5") == ("roco", {"std_ratio": 0.5})
    assert parse_method_spec("h2o") == ("h2o", {})


def test_an_empty_method_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="method"):
        parse_method_spec(":window=4")
