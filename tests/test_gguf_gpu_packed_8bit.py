"""GGUF 5/6/8-bit projections kept packed for the GPU (``gguf_packed.pack_4bit`` -> ``GGUF8bitLinear``, the int8-block
matmul): a tiny Llama whose tensors mix Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, Q3_K and 4-bit types (layer 0's q/k/v as
llama.cpp's Q4_K_M has them: Q4_K, Q4_K, Q6_K) loads with every projection packed and gives the logits of the
fully dequantized model, here on the CPU (the op's reference).  The tests marked ``gpu`` run the engine's own
loading and the kernels at LLM shapes on a CUDA / ROCm GPU (skipped elsewhere):

    .venv/bin/python -m pytest -q tests/test_gguf_gpu_packed_8bit.py tests/test_matmul_int8_block.py
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from ._gguf_writer import BYTE_VOCAB, add_byte_vocab, gguf_metadata, gguf_tensors  # noqa: E402
from .test_gguf_8bit import FP16_FIELDS  # noqa: E402
from .test_models_llama import full_logits, greedy  # noqa: E402

from anygpu.models import GGUFCheckpoint, gguf_packed  # noqa: E402
from anygpu.models.registry import build_model  # noqa: E402
from anygpu.nn.linear_gguf_4bit import GGUF4bitLinear  # noqa: E402
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear  # noqa: E402
from anygpu.quant import gguf_4bit  # noqa: E402
from anygpu.quant.gguf_blocks import BLOCK_SHAPES  # noqa: E402

# GGUF tensor -> type (the rest of the matrices, the embedding and the head, Q8_0)
TYPES = {"blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K",  # Q4_K_M's qkv: one int8 layer
         "blk.0.attn_output": "Q8_0", "blk.0.ffn_gate": "Q5_K", "blk.0.ffn_up": "Q5_0", "blk.0.ffn_down": "Q6_K",
         "blk.1.attn_q": "Q5_1", "blk.1.attn_k": "Q5_1", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q4_0",
         "blk.1.ffn_gate": "Q4_0", "blk.1.ffn_up": "IQ4_NL",  # two 4-bit code tables: no 4-bit layer, an int8 one
         "blk.1.ffn_down": "Q3_K"}
EIGHT_BIT = ["layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj", "layers.0.self_attn.o_proj",
             "layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "layers.1.mlp.gate_up_proj",
             "layers.1.self_attn.qkv_proj"]


def quantized(array: np.ndarray, type_name: str, rng) -> np.ndarray:
    """The array in ``type_name``'s blocks where a quantizer exists (gguf-py's, or gguf_4bit's Q4_K), else random
    blocks with small fp16 scales (weights of the model's size): the test compares two loadings of one file."""
    if type_name == "Q4_K":
        return gguf_4bit.quantize_q4_k(torch.from_numpy(array)).numpy()
    try:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        pass
    block, size = BLOCK_SHAPES[type_name]
    raw = rng.integers(0, 256, (array.size // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        d = (rng.random(raw.shape[0]) * 9e-6 + 1e-6).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(array.shape[0], -1)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    config = transformers.LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("gguf8") / "mixed8.gguf")
    w = gguf.GGUFWriter(path, "llama")
    types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
             str: gguf.GGUFValueType.STRING}
    for key, value in gguf_metadata("llama", config).items():
        w.add_key_value(f"llama.{key}", value, types[type(value)])
    add_byte_vocab(w)
    for name, array in gguf_tensors("llama", hf).items():
        array = np.ascontiguousarray(array)
        if array.ndim != 2:
            w.add_tensor(name, array)
            continue
        type_name = TYPES.get(name.removesuffix(".weight"), "Q8_0")
        w.add_tensor(name, quantized(array, type_name, rng), raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_mixed_file_loads_every_projection_packed_and_gives_the_dequantized_logits(mixed_file):
    ckpt = GGUFCheckpoint(mixed_file)
    reference = build_model(ckpt.config, ckpt.weights(progress=False))  # every tensor dequantized (fp32)
    counts = []
    model = build_model(ckpt.config, ckpt.weights(progress=False, skip=gguf_packed.packed_tensors(ckpt)),
                        prepare=lambda m: counts.append(gguf_packed.pack_4bit(m, ckpt)))
    eight = {name: m for name, m in model.named_modules() if isinstance(m, GGUF8bitLinear)}
    four = {name: m for name, m in model.named_modules() if isinstance(m, GGUF4bitLinear)}
    assert sorted(eight) == EIGHT_BIT and sorted(four) == ["layers.1.self_attn.o_proj"] and counts == [8]
    qkv0 = eight["layers.0.self_attn.qkv_proj"]
    assert qkv0.blocksize == 16 and qkv0.offset is not None  # Q6_K's blocks of 16; Q4_K's offsets (zeros for v)
    assert eight["layers.0.self_attn.o_proj"].blocksize == 32 and eight["layers.0.self_attn.o_proj"].offset is None
    assert eight["layers.1.mlp.down_proj"].blocksize == 16  # Q3_K
    assert not any(n.endswith("proj.weight") for n, _ in model.named_buffers())  # no projection was dequantized
    references = dict(reference.named_modules())
    for name, layer in eight.items():  # the file's values bit for bit, q/k rows in HF's order
        assert torch.equal(layer.dequantize(), references[name].weight), name
    ids = [256, 72, 101, 108, 108, 111, 44, 32, 119]
    torch.testing.assert_close(full_logits(model, ids), full_logits(reference, ids))


def assert_narrowed(layer: GGUF8bitLinear, w: torch.Tensor, what: str) -> None:
    """The layer's values are ``w``'s (the file's), exactly with fp32 scales, within ``gguf_8bit.narrow``'s bound
    (2^-11 of a block's largest |code| * |scale| + |offset|) with fp16 ones."""
    got = layer.dequantize()
    if layer.scale.dtype == torch.float32:
        assert torch.equal(got, w), what
        return
    assert layer.offset is None or layer.offset.dtype == torch.float16, what
    size = layer.codes.reshape(-1, layer.blocksize).abs().amax(dim=1).float() * layer.scale.float().abs()
    if layer.offset is not None:
        size = size + layer.offset.float().abs()
    bound = (2.0 ** -11 * size).repeat_interleave(layer.blocksize).reshape(w.shape)
    assert bool(((got - w).abs() <= bound).all()), what


def test_bf16_model_loads_fp16_scales(mixed_file):
    """A 16-bit model (the GPU engine's) takes each packed layer's scales in fp16 where ``narrow`` allows; its
    logits stay within bf16's reach of the fp32-scale model's."""
    ckpt = GGUFCheckpoint(mixed_file)
    reference = dict(build_model(ckpt.config, ckpt.weights(progress=False)).named_modules())
    model = build_model(ckpt.config, ckpt.weights(progress=False, skip=gguf_packed.packed_tensors(ckpt)),
                        dtype=torch.bfloat16, prepare=lambda m: gguf_packed.pack_4bit(m, ckpt))
    eight = {name: m for name, m in model.named_modules() if isinstance(m, GGUF8bitLinear)}
    assert sorted(eight) == EIGHT_BIT
    assert any(m.scale.dtype == torch.float16 for m in eight.values())
    for name, layer in eight.items():
        assert_narrowed(layer, reference[name].weight, name)


def test_turned_off_dequantizes_on_gpus(monkeypatch):
    monkeypatch.setenv("ANYGPU_GPU_GGUF_PACKED", "0")
    assert not gguf_packed.enabled(torch.device("cuda", 0))


@pytest.mark.gpu
def test_engine_on_a_gpu_keeps_the_8bit_projections_packed(mixed_file, monkeypatch):
    """The engine's own loading on a GPU (one process): the projections are GGUF8bitLinear (and one
    GGUF4bitLinear), each within bf16's rounding of its dequantized layer on every path of the plan (1 row: GEMV,
    4 and 16: GEMM, 100: dequantize + vendor GEMM), and greedy decoding runs (CUDA graphs)."""
    from anygpu.engine import LLMEngine
    from anygpu.testing import assert_accurate

    monkeypatch.delenv("ANYGPU_GPU_GGUF_PACKED", raising=False)
    engine = LLMEngine(mixed_file, progress=False, block_size=16, max_model_len=64, device="cuda")
    try:
        eight = {n: m for n, m in engine.model.named_modules() if isinstance(m, GGUF8bitLinear)}
        assert sorted(eight) == EIGHT_BIT and all(m.codes.is_cuda for m in eight.values())
        ckpt = GGUFCheckpoint(mixed_file)
        reference = dict(build_model(ckpt.config, ckpt.weights(progress=False)).named_modules())
        for name, layer in eight.items():
            w = reference[name].weight.cuda()
            assert_narrowed(layer, w, name)  # a bf16 engine: fp16 scales where the rule allows
            for m in (1, 4, 16, 100):
                x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
                assert_accurate(layer(x), F.linear(x, w.bfloat16()), F.linear(x.float(), w), what=f"{name} m={m}")
        assert len(greedy(engine, [256, 72, 101, 108], 8)) == 8
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,blocksize,offset", [(4096, 4096, 32, False), (1024, 4096, 16, True),
                                                  (4096, 14336, 16, False), (14336, 4096, 32, True)])
def test_op_at_llm_shapes(dtype, n, k, blocksize, offset):
    """Llama-3-8B's projection shapes (a TP shard's narrow one too), every row count the plan distinguishes."""
    from anygpu.ops import matmul_int8_block
    from anygpu.ops.matmul_int8_block import dequantize_weight
    from anygpu.testing import assert_accurate

    g = torch.Generator(device="cuda").manual_seed(n + k)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    scale = torch.rand(n * k // blocksize, device="cuda", generator=g) * 2e-4
    off = (torch.rand(n * k // blocksize, device="cuda", generator=g) - 0.5) * 4e-3 if offset else None
    w = dequantize_weight(codes, scale, blocksize, torch.float32, off)
    for m in (1, 2, 8, 16, 33, 64, 65, 512):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        y = matmul_int8_block(x, codes, scale, blocksize, bias, off)
        assert_accurate(y, F.linear(x, w.to(dtype), bias), F.linear(x.float(), w, bias.float()), what=f"m={m}")


@pytest.mark.gpu
def test_gemv_replays_in_a_cuda_graph():
    """Decode runs in CUDA / HIP graphs: the GEMV (split K, its reduce launch) captures and replays."""
    from anygpu.ops import matmul_int8_block

    codes = torch.randint(-128, 128, (512, 4096), dtype=torch.int8, device="cuda")
    scale = torch.rand(512 * 4096 // 32, device="cuda") * 1e-3
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul_int8_block(x, codes, scale, 32)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matmul_int8_block(x, codes, scale, 32)
    x.copy_(torch.randn_like(x))
    want = matmul_int8_block(x, codes, scale, 32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
