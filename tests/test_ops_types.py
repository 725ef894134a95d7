"""Every op refuses a non-tensor where its schema says Tensor with a TypeError naming the argument (issue 21, item
11: ``ops.rms_norm([[1.0]*64], w, 1e-6)`` raised ``AttributeError: 'list' object has no attribute 'dim'``)."""

import pytest
import torch

from anygpu import ops
from anygpu.ops import ALL_OPS


def _tensor_args(op):
    return [(i, a.name, a.type.kind() == "OptionalType") for i, a in enumerate(op.overload._schema.arguments)
            if "Tensor" in str(a.type)]


def _placeholders(op):
    """A tensor for every Tensor argument and the schema's default (or 0) elsewhere: the type check comes first."""
    out = []
    for a in op.overload._schema.arguments:
        if "Tensor" in str(a.type):
            out.append(torch.zeros(4))
        else:
            out.append(a.default_value if a.has_default_value() else 0)
    return out


CASES = [(name, i, arg, optional) for name, op in sorted(ALL_OPS.items()) for i, arg, optional in _tensor_args(op)]


def test_every_op_has_tensor_arguments():
    assert len(ALL_OPS) >= 15 and {name for name, *_ in CASES} == set(ALL_OPS)


@pytest.mark.parametrize("bad", [[[1.0] * 64], 3.0, "x"], ids=["list", "float", "str"])
@pytest.mark.parametrize("name, index, arg, optional", CASES, ids=[f"{c[0]}.{c[2]}" for c in CASES])
def test_non_tensor_named(name, index, arg, optional, bad):
    op = ALL_OPS[name]
    args = _placeholders(op)
    args[index] = bad
    with pytest.raises(TypeError, match=f"^{name}: {arg}: expected a torch.Tensor"
                                        f"{' or None' if optional else ''}, got {type(bad).__name__}$"):
        op(*args)
    with pytest.raises(TypeError, match=f"{name}: {arg}: expected a torch.Tensor"):  # by keyword too
        op(**{a.name: v for a, v in zip(op.overload._schema.arguments, args)})


def test_the_issue_case_and_a_good_call():
    w = torch.ones(64)
    with pytest.raises(TypeError, match=r"^rms_norm: x: expected a torch.Tensor, got list$"):
        ops.rms_norm([[1.0] * 64], w, 1e-6)
    x = torch.randn(2, 64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_none_is_accepted_where_optional():
    """int8_matmul's bias is ``Tensor?``: None passes the type check and the op runs."""
    x = torch.randn(3, 8)
    cb = torch.randint(-127, 128, (5, 8), dtype=torch.int8)
    scb = torch.rand(5) + 0.5
    out = ops.int8_matmul(x, cb, scb, 0.0, None)
    assert out.shape == (3, 5)
    with pytest.raises(TypeError, match="^int8_matmul: x: expected a torch.Tensor, got NoneType$"):
        ops.int8_matmul(None, cb, scb, 0.0, None)
