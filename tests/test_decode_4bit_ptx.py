"""The 4-bit decoders' inline PTX (``anygpu/kernels/_decode_4bit.py`` and ``_decode_4bit_linear.py``), run by a small
interpreter (``tests/_ptx_sim.py``) on words of random codes: each decoded value must be the table's value of the
code at its element position (bitsandbytes' order: element 2i in the high nibble of byte i), and each word's dot the
exact sum (activations chosen so that 16-bit sums are exact). The GPU tests run the same strings inside the kernels."""

import random

import pytest
import torch

from anygpu.kernels import _decode_4bit as T
from anygpu.kernels import _decode_4bit_linear as D
from anygpu.quant import get_4bit_type
from anygpu.quant.gguf_4bit import code_table
from ._ptx_sim import run

KINDS = {"f16": torch.float16, "bf16": torch.bfloat16}


def bits16(v: float, t: str) -> int:
    return torch.tensor(v, dtype=KINDS[t]).view(torch.int16).item() & 0xFFFF


def value(b: int, t: str) -> float:
    return torch.tensor(b & 0xFFFF, dtype=torch.int32).to(torch.int16).view(KINDS[t]).item()


def codes_of(word: int) -> list[int]:
    """The 8 codes of a little-endian word in element order."""
    return [(word >> (8 * (e // 2) + (4 if e % 2 == 0 else 0))) & 15 for e in range(8)]


def pair(lo: int, hi: int) -> int:
    return lo | (hi << 16)


def table_registers(code: torch.Tensor, t: str) -> list[int]:
    """``_tables``'s 8 registers: the low bytes of codes 4i..4i+3, then their high bytes."""
    v = [bits16(float(c), t) for c in code]
    lo = [sum((v[4 * i + j] & 0xFF) << (8 * j) for j in range(4)) for i in range(4)]
    hi = [sum((v[4 * i + j] >> 8) << (8 * j) for j in range(4)) for i in range(4)]
    return lo + hi


def words(n=64, seed=0):
    rng = random.Random(seed)
    return [0, 0xFFFFFFFF, 0x01234567, 0x89ABCDEF] + [rng.getrandbits(32) for _ in range(n)]


def small_x(rng, t):
    # integers in [-2, 2]: every product with (q - 8) / 8 and every sum of four is exact in fp16 and bf16
    return [rng.randint(-2, 2) for _ in range(8)]


@pytest.mark.parametrize("t", ["f16", "bf16"])
def test_linear_dot_is_the_exact_sum(t):
    rng = random.Random(1)
    ptx = (D.DOT8_LINEAR_F16 if t == "f16" else D.DOT8_LINEAR_BF16).value
    for w in words():
        x = small_x(rng, t)
        xb = [bits16(v, t) for v in x]
        xa, xb_, xc, xd = (pair(xb[2 * i], xb[2 * i + 1]) for i in range(4))
        perm = run(D.X_PAIRS_LINEAR.value, {4: xa, 5: xb_, 6: xc, 7: xd})
        out = run(ptx, {1: perm[0], 2: perm[1], 3: perm[2], 4: perm[3], 5: w})[0]
        want = sum(xi * (q - 8) / 8 for xi, q in zip(x, codes_of(w)))
        assert out == want, (hex(w), x)


@pytest.mark.parametrize("t", ["f16", "bf16"])
def test_linear_pairs_decode_each_element(t):
    ptx = (D.DECODE_PAIRS_LINEAR_F16 if t == "f16" else D.DECODE_PAIRS_LINEAR_BF16).value
    for w in words():
        out = run(ptx, {4: w})
        q = codes_of(w)
        got = {name: (value(out[i], t), value(out[i] >> 16, t)) for i, name in enumerate(("e02", "e46", "e13", "e57"))}
        want = {"e02": (q[0], q[2]), "e46": (q[4], q[6]), "e13": (q[1], q[3]), "e57": (q[5], q[7])}
        for name, (a, b) in want.items():
            assert got[name] == ((a - 8) / 8, (b - 8) / 8), (hex(w), name)


def test_linear_code_is_gguf_q4_table():
    # the launcher takes the arithmetic decoder for exactly this table
    assert torch.equal(code_table("q4"), torch.tensor(D.LINEAR_CODE, dtype=torch.float32))


@pytest.mark.parametrize("t", ["f16", "bf16"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_table_decoders_put_each_code_at_its_element(t, quant_type):
    code = get_4bit_type(quant_type)
    tables = table_registers(code, t)
    want = [value(bits16(float(c), t), t) for c in code]
    dot = (T.DOT8_F16 if t == "f16" else T.DOT8_BF16).value
    one = bits16(1.0, t)
    for w in words(16):
        q = codes_of(w)
        out = run(T.DECODE_PAIRS.value, {4: w, **{5 + 4 * i + j: tables[i] for i in range(8) for j in range(4)}})
        assert [value(out[0], t), value(out[0] >> 16, t), value(out[1], t), value(out[1] >> 16, t)] == \
            [want[q[e]] for e in (0, 2, 4, 6)]
        assert [value(out[2], t), value(out[2] >> 16, t), value(out[3], t), value(out[3] >> 16, t)] == \
            [want[q[e]] for e in (1, 3, 5, 7)]
        for e in range(8):  # x = 1 at element e only: the dot is that element's value
            xs = [one if i == e else 0 for i in range(8)]
            xp = {1 + i: pair(xs[2 * i], xs[2 * i + 1]) for i in range(4)}
            out = run(dot, {**xp, 5: w, **{6 + i: tables[i] for i in range(8)}})[0]
            assert out == want[q[e]], (hex(w), e)


def test_interpreter_rounds_pair_fma_to_nearest_even():
    # 1 + 2^-11 is a tie in fp16 (rounds to 1.0); 1 + 3 * 2^-11 rounds up to 1 + 2^-9
    ptx = "fma.rn.f16x2 $0, $1, $2, $3;"
    one, tiny = bits16(1.0, "f16"), bits16(2 ** -11, "f16")
    three = bits16(3.0, "f16")
    out = run(ptx, {1: pair(tiny, tiny), 2: pair(one, three), 3: pair(one, one)})[0]
    assert (value(out, "f16"), value(out >> 16, "f16")) == (1.0, 1.0 + 2 ** -9)
    assert run("add.f32 $0, $1, $2;", {1: 0x3F800000, 2: 0x40000000})[0] == 3.0


def test_linear_code_is_remembered_per_table_for_a_whole_model(monkeypatch):
    """Every layer has its own table tensor: all of a large model's stay remembered (no device read per call),
    an edited table is compared again, and dead ones make room."""
    monkeypatch.setattr(D, "LINEAR_DECODE", True)
    tables = [code_table("q4") for _ in range(600)]
    assert all(D.linear_code(t) for t in tables)
    reads = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(1) or real_equal(a, b))
    assert all(D.linear_code(t) for t in tables) and not reads
    tables[0][3] = 0.5
    assert not D.linear_code(tables[0]) and len(reads) == 1
    del tables
    monkeypatch.setattr(D, "_LINEAR_SEEN_MAX", 8)
    assert D.linear_code(code_table("q4")) and len(D._LINEAR_SEEN) <= 8


def test_linear_decoder_is_off_unless_asked(monkeypatch):
    monkeypatch.setattr(D, "LINEAR_DECODE", False)
    assert not D.linear_code(code_table("q4"))
