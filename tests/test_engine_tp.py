"""Tensor parallelism on the CPU: gloo ranks in real spawned processes give the same greedy tokens as one rank.

Tiny fp32 models saved by transformers (Llama with KV heads split over the ranks or replicated on them, and a
vocabulary that does not split evenly; Qwen2 with q/k/v biases and a tied head), and random weights (the same
full tensors whatever tp is): batched requests arriving over several steps, chunked prefills mixed with decodes;
quantized shards; bad ``tp`` values; worker failures and shutdown (no process left behind).  About 30 s on 2
cores, most of it starting worker processes (a fresh interpreter importing torch each time).

The checkpoints carry the token checks: transformers' init (std 0.02) makes every layer matter, while vLLM-style
random weights (uniform +-1e-3) leave the tokens to the embedding and head, blind to a wrong KV-head shard.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.models import ModelConfig
from anygpu.models import parallel
from anygpu.models.parallel import TensorParallel
from anygpu.models.registry import build_model, random_weights

TINY = ModelConfig(architecture="llama", vocab_size=1001, hidden_size=256, intermediate_size=512, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                   max_position=256, tie_word_embeddings=False, attention_bias=False, sliding_window=None,
                   bos_token_id=1, eos_token_ids=(2,), dtype=None)
PROMPTS = [[5, 17, 300, 42, 7, 99, 512, 3], list(range(10, 50)), [900, 4, 4, 4, 31], list(range(200, 230))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# A 16-token budget chunks the 40- and 30-token prompts over several steps; with prompts arriving one step
# apart, steps mix prefill chunks and decodes (paged_prefill), and pure decode steps follow.
ENGINE = dict(progress=False, device="cpu", max_num_seqs=4, max_num_batched_tokens=16, block_size=8)


def tokens(engine: LLMEngine, params=GREEDY) -> list[list[int]]:
    out, pending = {}, list(enumerate(PROMPTS))
    while pending or engine.has_unfinished():
        if pending:  # one new request per step
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [out[str(i)] for i in range(len(PROMPTS))]


def _engine(tp: int, model=None, **kwargs) -> LLMEngine:
    return LLMEngine(model, tp=tp, **{**ENGINE, **kwargs})


def run(tp: int, model=None, **kwargs) -> list[list[int]]:
    engine = _engine(tp, model, **kwargs)
    try:
        return tokens(engine)
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def _no_children_left():
    yield
    assert multiprocessing.active_children() == []


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name)``: the folder of a tiny model saved by transformers, made on first use.  "llama": 2 KV
    heads (split over 2 ranks), an odd vocabulary (a padded head shard); "llama-kv1": 1 KV head (replicated);
    "qwen2-tied": q/k/v biases and a tied head."""
    transformers = pytest.importorskip("transformers")
    folders = {}

    def make(name: str):
        if name not in folders:
            common = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_hidden_layers=2,
                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
            torch.manual_seed(1)
            if name.startswith("llama"):
                cfg = transformers.LlamaConfig(head_dim=64, tie_word_embeddings=False, vocab_size=1001,
                                               num_key_value_heads=1 if name == "llama-kv1" else 2, **common)
                model = transformers.LlamaForCausalLM(cfg)
            else:
                cfg = transformers.Qwen2Config(tie_word_embeddings=True, vocab_size=1024, num_key_value_heads=2,
                                               **common)
                model = transformers.Qwen2ForCausalLM(cfg)
                with torch.no_grad():  # transformers initializes the biases to zero: make them matter
                    for layer in model.model.layers:
                        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                            proj.bias.normal_(0, 0.1)
            folders[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(folders[name])
        return str(folders[name])

    return make


@pytest.mark.parametrize("name", ["llama", "llama-kv1", "qwen2-tied"])
def test_tp2_checkpoint_equals_tp1(checkpoints, name):
    one = run(1, checkpoints(name))
    assert len(set(map(tuple, one))) == len(PROMPTS)  # every prompt leads somewhere else: the model is no echo
    assert run(2, checkpoints(name)) == one


def test_tp2_random_model_equals_tp1():
    modes = set()
    engine = _engine(2, config=TINY)
    (worker,) = multiprocessing.active_children()
    pack = engine.runner.pack

    def recording_pack(batch, *args, **kwargs):
        message, *rest = pack(batch, *args, **kwargs)
        modes.add(int(message[0]))
        return (message, *rest)

    engine.runner.pack = recording_pack
    try:
        two = tokens(engine)
    finally:
        engine.close()
    engine.close()  # twice is fine
    assert worker.exitcode == 0  # a clean shutdown, not a kill
    assert modes == {0, 1, 2}  # prefill, decode and mixed steps all crossed to the worker
    assert engine.model.tp.all_reduce_path == "gloo"  # no symmetric memory on the CPU
    assert two == run(1, config=TINY)


def first_token_logits(engine: LLMEngine) -> torch.Tensor:
    """[prompts, vocab]: the logits each prompt's first token is sampled from (they depend on the prompt only)."""
    captured, execute = [], engine.runner.execute
    engine.runner.execute = lambda message: captured.append(execute(message)) or captured[-1]
    try:
        tokens(engine, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    finally:
        engine.runner.execute = execute
    return torch.cat([c for c in captured if c is not None])


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_tp2_quantized_is_as_good_as_tp1_quantized(checkpoints, quantize):
    # Quantized shards are not shards of the quantized matrix: per-shard statistics differ from whole-matrix
    # ones (NF4's double-quantized block scales are offset by the mean over the shard's blocks; LLM.int8()'s
    # row-parallel weight and activation scales are absmaxes over the rank's columns only).  So TP=2 is a
    # slightly different quantized model, and its greedy tokens drift from TP=1's after a few (on this model:
    # token 3 for nf4, whose logits differ by 0.007 where quantizing moved them by 0.24).  What must hold: it
    # approximates the unquantized model as well as TP=1 does, picks the same first tokens, and runs on.
    path = checkpoints("llama")
    exact = first_token_logits(_engine(1, path))
    one = first_token_logits(_engine(1, path, quantize=quantize))
    engine = _engine(2, path, quantize=quantize)
    try:
        two = first_token_logits(engine)
        generated = tokens(engine)
    finally:
        engine.close()
    error_one, error_two = ((x - exact).norm() / exact.norm() for x in (one, two))
    assert 0 < error_one and error_two < 1.1 * error_one
    assert torch.equal(two.argmax(-1), one.argmax(-1))
    assert [len(t) for t in generated] == [GREEDY.max_tokens] * len(PROMPTS)


def test_shards_tile_the_full_weights():
    # No processes: each rank's model loads its cut of the same full tensors; put together they are the whole.
    cfg = dataclasses.replace(TINY, num_kv_heads=1, vocab_size=1001, attention_bias=True)
    whole = build_model(cfg, "random")
    ranks = [build_model(cfg, "random", tp=TensorParallel(r, 2)) for r in range(2)]
    full = dict(random_weights(cfg))
    q, kv = 2 * 64, 64  # per rank: 2 of the 4 query heads, the single KV head on both
    for r, model in enumerate(ranks):
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        qkv = attn.qkv_proj.weight
        assert torch.equal(qkv[:q], full["model.layers.0.self_attn.q_proj.weight"][r * q:(r + 1) * q])
        assert torch.equal(qkv[q:q + kv], full["model.layers.0.self_attn.k_proj.weight"])  # replicated
        assert torch.equal(attn.qkv_proj.bias[q + kv:], full["model.layers.0.self_attn.v_proj.bias"])
        assert torch.equal(attn.o_proj.weight, full["model.layers.0.self_attn.o_proj.weight"][:, r * q:(r + 1) * q])
        assert torch.equal(mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, r * 256:(r + 1) * 256])
        assert model.lm_head.weight.shape == (501, 256)
    head = torch.cat([m.lm_head.weight for m in ranks])
    assert torch.equal(head[:1001], whole.lm_head.weight)
    assert not head[1001:].any()  # the padding row of the last rank
    for model in [whole, *ranks]:
        assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"])  # replicated


@pytest.mark.parametrize("tp, match", [(3, "tp: 3 ranks cannot split num_heads=4"), (0, "tp: expected a positive int"),
                                       ("2", "tp: expected a positive int"), (True, "tp: expected a positive int"),
                                       (8, "tp: 8 ranks cannot split num_heads=4")])
def test_bad_tp_is_a_value_error(tp, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(config=TINY, tp=tp, **ENGINE)


def test_bad_tp_for_kv_heads_and_mlp():
    with pytest.raises(ValueError, match="tp: 4 ranks cannot split num_kv_heads=6"):
        LLMEngine(config=dataclasses.replace(TINY, num_heads=12, num_kv_heads=6, head_dim=16), tp=4, **ENGINE)
    with pytest.raises(ValueError, match="tp: 2 ranks cannot split intermediate_size=511"):
        LLMEngine(config=dataclasses.replace(TINY, intermediate_size=511), tp=2, **ENGINE)


def test_tp_over_more_gpus_than_visible_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="tp: 2 ranks need 2 GPUs from cuda:1 on, but 1 are visible"):
        LLMEngine(config=TINY, tp=2, **{**ENGINE, "device": "cuda:1"})
    with pytest.raises(ValueError, match="tp: tensor parallelism runs on CUDA/ROCm GPUs or the CPU"):
        LLMEngine(config=TINY, tp=2, **{**ENGINE, "device": "meta"})


def test_worker_failure_is_reported_and_nothing_is_left(tmp_path):
    # Rank 0 builds its random model; the worker fails to open the checkpoint it is pointed at.
    from anygpu.engine.distributed import RankSpec, TPWorkers

    spec = RankSpec(TINY, str(tmp_path / "missing"), torch.float32, torch.device("cpu"), world_size=2)
    workers = TPWorkers(spec)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)tp: worker 1 failed while starting.*FileNotFoundError"):
            workers.wait_for("built")
    finally:
        workers.close()


def test_garbage_collection_stops_the_workers():
    engine = _engine(2, config=TINY)
    (worker,) = multiprocessing.active_children()
    del engine
    gc.collect()
    assert multiprocessing.active_children() == [] and worker.exitcode == 0


def test_engine_that_fails_after_starting_its_workers_stops_them():
    with pytest.raises(ValueError, match="max_model_len: 64 tokens do not fit the KV cache"):
        _engine(2, config=TINY, num_kv_blocks=2, max_model_len=64)
    # (the autouse fixture checks that no worker is left)


# -- the all-reduce path (the symmetric-memory one itself runs on 2 GPUs: test_engine_gpu.py) ------------------
def test_all_reduce_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv("ANYGPU_TP_ALLREDUCE", raising=False)
    assert parallel.all_reduce_mode() == "auto"
    for value, mode in [("", "auto"), (" NCCL ", "nccl"), ("symm_mem", "symm_mem"), ("auto", "auto")]:
        monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", value)
        assert parallel.all_reduce_mode() == mode
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match="ANYGPU_TP_ALLREDUCE: expected one of auto, nccl, symm_mem, got 'fast'"):
        parallel.all_reduce_mode()
    with pytest.raises(ValueError, match="ANYGPU_TP_ALLREDUCE"):  # before any worker is spawned
        LLMEngine(config=TINY, tp=2, **ENGINE)


def test_symm_mem_support_decision(monkeypatch):
    cuda = torch.device("cuda", 0)
    unsupported = parallel.symm_mem_unsupported
    assert unsupported(cuda, 2, torch.bfloat16) is None  # (torch 2.11+ has the ops, CPU builds too)
    assert unsupported(cuda, 8, torch.float32) is None
    assert unsupported("cpu", 2, torch.bfloat16) == "cpu device"
    assert "3 ranks" in unsupported(cuda, 3, torch.bfloat16)
    assert "torch.float16" in unsupported(cuda, 2, torch.float16)  # the kernels have no fp16
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "ROCm" in unsupported(cuda, 2, torch.bfloat16)
    assert unsupported(cuda, 2, torch.bfloat16, forced=True) is None  # forced: tried, falls back if setup fails
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert "needs 2.11" in unsupported(cuda, 2, torch.bfloat16)


def test_forcing_symm_mem_where_it_cannot_run_is_a_value_error(monkeypatch):
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", "symm_mem")
    with pytest.raises(ValueError, match="ANYGPU_TP_ALLREDUCE=symm_mem: .* cannot run here: cpu device"):
        LLMEngine(config=TINY, tp=2, **ENGINE)
    LLMEngine(config=TINY, tp=1, **ENGINE)  # one rank: no all-reduce to choose


class FakeSymmMemOps:
    """The symm_mem ops on the CPU, as if every rank held the same input: the sum is world_size times it."""

    def __init__(self, world_size: int, fused: bool = True):
        self.world_size, self.calls = world_size, []
        if fused:
            self.one_shot_all_reduce_copy = self._copy

    def one_shot_all_reduce(self, buf, op, group_name):
        self.calls.append("one_shot")
        return buf * self.world_size

    def _copy(self, buf, x, op, group_name):
        self.calls.append("one_shot_copy")
        buf.copy_(x)
        return buf * self.world_size

    def two_shot_all_reduce_(self, buf, op, group_name):
        self.calls.append("two_shot")
        return buf.mul_(self.world_size)


@pytest.mark.parametrize("world_size, fused, numel, calls", [
    (2, True, 8 * 256, ["one_shot_copy"]), (2, False, 8 * 256, ["one_shot"]),
    (2, True, 1 << 20, ["one_shot_copy"]),  # 2 ranks: one-shot whatever the size
    (4, True, 8 * 256, ["one_shot_copy"]), (4, True, 1 << 20, ["two_shot"])])  # 2 MiB: over ONE_SHOT_MAX_BYTES
def test_symm_mem_all_reduce_paths(world_size, fused, numel, calls):
    ops = FakeSymmMemOps(world_size, fused)
    fast = parallel._SymmMemAllReduce(torch.zeros(2 << 20, dtype=torch.bfloat16), "0", world_size, ops=ops)
    x = torch.randn(numel // 256, 256).bfloat16()
    expect = x * world_size
    assert fast.fits(x)
    out = fast(x)
    assert ops.calls == calls and torch.equal(out, expect)
    assert torch.equal(fast.buffer[:numel].view_as(x), x if calls != ["two_shot"] else expect)
    if calls == ["two_shot"]:
        assert out is x  # in place, like dist.all_reduce (the buffer is the next call's)


def test_symm_mem_all_reduce_takes_what_fits_and_leaves_the_rest_to_the_process_group(monkeypatch):
    fast = parallel._SymmMemAllReduce(torch.zeros(4096, dtype=torch.bfloat16), "0", 2, ops=FakeSymmMemOps(2))
    x = torch.randn(16, 256).bfloat16()
    assert fast.fits(x) and fast.fits(x[8:])
    assert not fast.fits(x.half())  # another dtype
    assert not fast.fits(torch.randn(17, 256).bfloat16())  # over the buffer
    assert not fast.fits(x.t())  # not contiguous
    assert not fast.fits(x.view(-1)[1:257])  # 2-byte offset: the kernels load 16-byte vectors
    assert not fast.fits(x.view(-1)[:7])  # 14 bytes
    tp = TensorParallel(0, 2)
    tp._fast = fast
    reduced = []
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda t, group=None: reduced.append(t))
    assert torch.equal(tp.all_reduce(x), 2 * x) and reduced == []
    y = x.half()
    assert tp.all_reduce(y) is y and reduced == [y]


@pytest.fixture
def fake_cuda_group(monkeypatch):
    """TensorParallel.init_fast_all_reduce on 'CUDA' with the collectives and the setup faked: the decision only."""
    monkeypatch.setattr(parallel.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(TensorParallel, "_peer_access", lambda self, device, agree: None)
    setups = []  # the buffer sizes asked for; a None in it makes the next setup fail

    def setup(numel, dtype, device, group, agree):
        if None in setups:
            raise RuntimeError("symmetric memory rendezvous: CUDA driver error")
        setups.append(numel)
        return parallel._SymmMemAllReduce(torch.zeros(numel, dtype=dtype), "0", 2, ops=FakeSymmMemOps(2))

    monkeypatch.setattr(parallel._SymmMemAllReduce, "setup", staticmethod(setup))
    return setups


@pytest.mark.parametrize("mode", ["", "auto", "symm_mem"])
def test_fast_all_reduce_is_set_up_where_supported(fake_cuda_group, monkeypatch, mode):
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", mode)
    tp = TensorParallel(0, 2)
    tp.init_fast_all_reduce(256 * 4096, torch.bfloat16, torch.device("cuda", 0))
    assert tp.all_reduce_path == "symm_mem" and fake_cuda_group == [256 * 4096]  # 2 MiB: under the cap
    tp.init_fast_all_reduce(256 * 4096, torch.bfloat16, torch.device("cuda", 0))  # once
    assert fake_cuda_group == [256 * 4096]
    TensorParallel(0, 2).init_fast_all_reduce(1024 * 8192, torch.float32, torch.device("cuda", 0))
    assert fake_cuda_group[1] == parallel.SYMM_MEM_BUFFER_MAX_BYTES // 4  # capped


def test_fast_all_reduce_falls_back_to_the_process_group(fake_cuda_group, monkeypatch, caplog):
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", "nccl")
    tp = TensorParallel(0, 2)
    tp.init_fast_all_reduce(4096, torch.bfloat16, torch.device("cuda", 0))
    assert tp.all_reduce_path == "nccl" and fake_cuda_group == [] and tp._fast is None
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", "auto")
    for dtype, device, world_size in [(torch.float16, "cuda:0", 2), (torch.bfloat16, "cpu", 2),
                                      (torch.bfloat16, "cuda:0", 3)]:
        tp = TensorParallel(0, world_size)
        tp.init_fast_all_reduce(4096, dtype, torch.device(device))
        assert tp.all_reduce_path == "nccl" and fake_cuda_group == []
    fake_cuda_group.append(None)
    tp = TensorParallel(0, 2)
    with caplog.at_level("WARNING", logger="anygpu.models.parallel"):
        tp.init_fast_all_reduce(4096, torch.bfloat16, torch.device("cuda", 0))
    assert tp.all_reduce_path == "nccl" and "could not be set up, using nccl" in caplog.text
    monkeypatch.setenv("ANYGPU_TP_ALLREDUCE", "symm_mem")
    with pytest.raises(RuntimeError, match="ANYGPU_TP_ALLREDUCE=symm_mem: .*rendezvous: CUDA driver error"):
        TensorParallel(1, 2).init_fast_all_reduce(4096, torch.bfloat16, torch.device("cuda", 0))
    one = TensorParallel()
    one.init_fast_all_reduce(4096, torch.bfloat16, torch.device("cuda", 0))
    assert one.all_reduce_path is None  # one rank: nothing to reduce
