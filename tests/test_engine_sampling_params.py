"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming the field for each bad value."""

import math

import numpy as np
import pytest

from anygpu.engine import SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.seed) == (1.0, 0.0, 0.0, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.stop is not SamplingParams().stop
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(3, np.int64(7)), max_tokens=np.int32(5), temperature=1,
                       seed=np.int64(9), top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 7] and type(p.stop_token_ids[1]) is int
    assert p.max_tokens == 5 and type(p.max_tokens) is int and type(p.temperature) is float and p.seed == 9
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0.0, top_p=1e-9, min_p=1.0, presence_penalty=-2, frequency_penalty=2)


BAD = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", "10"),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("temperature", None), ("top_k", -2), ("top_k", 1.5), ("top_k", "5"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", "1"),
    ("min_p", -0.01), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf), ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3), ("frequency_penalty", math.nan), ("seed", 1.5), ("seed", "42"),
    ("stop", 5), ("stop", ["ok", 3]), ("stop", [""]), ("stop_token_ids", [1, "2"]), ("stop_token_ids", 7),
    ("stop_token_ids", [1.0]), ("ignore_eos", 1), ("skip_special_tokens", None),
    ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        SamplingParams(**{field: value})


def test_validate_checks_stop_token_ids_against_the_vocabulary():
    p = SamplingParams(stop_token_ids=[0, 99])
    p.validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"stop_token_ids: expected ids in \[0, 50\).*\[99\]"):
        p.validate(vocab_size=50)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).validate(vocab_size=10)


def test_validate_catches_later_edits_and_clone_copies():
    p = SamplingParams(temperature=0.5, stop=["x"])
    p.top_p = 0
    with pytest.raises(ValueError, match="^top_p"):
        p.validate()
    q = SamplingParams(stop=["x"]).clone(temperature=0.0)
    assert q.temperature == 0.0 and q.stop == ["x"]
    q.stop.append("y")
    with pytest.raises(ValueError, match="^max_tokens"):
        q.clone(max_tokens=0)
