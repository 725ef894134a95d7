"""QLoRA under FSDP on anygpu's 4-bit layers, bitsandbytes' documented recipe, on the CPU over gloo.

The recipe (bitsandbytes' and PEFT's FSDP-QLoRA guides): 4-bit weights stored in the dtype of the other params
(``quant_storage=torch.bfloat16``) so FSDP can flatten them with the rest, ``use_orig_params=True`` (frozen
quantized weights and trainable LoRA params in one flat parameter), LoRA through PEFT.  With
``use_orig_params=True`` FSDP keeps each original parameter object and points its data at the flat parameter's
views, so a ``Params4bit`` keeps its ``quant_state`` (``Linear4bit`` would re-attach the layer's state to a plain
parameter as bitsandbytes does, should a wrapper replace it).  Checked: a training run under FSDP gives the losses
of the same run without it, step for step, and the full state dict gathered from FSDP (quant-state keys included,
resolved through Params4bit's attributes) loads into a plain model with the same outputs.

Each run is a script in a subprocess that spawns the ranks: a torch.distributed process group lasts for the
process.  Not covered: ``use_orig_params=False`` (FSDP refuses frozen and trainable params in one flat parameter:
"Must flatten tensors with uniform requires_grad", the same for any model), and the full state dict with
``offload_to_cpu=True``, which crashes torch's FSDP on CPU-only ranks (a segfault with plain nn.Linear layers too).
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("peft")

SCRIPT = r'''
import json, os, sys, traceback, warnings
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

warnings.filterwarnings("ignore")  # FSDP's deprecation notices and its NO_SHARD notice at world size 1


def build():
    import peft
    from anygpu.integrations.peft import register_lora
    from anygpu.nn import quantize_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
    quantize_model(model, "nf4", skip=(), quant_storage=torch.bfloat16, compute_dtype=torch.bfloat16, progress=False)
    config = register_lora(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0", "2"], lora_dropout=0.0))
    model = peft.get_peft_model(model, config)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # one dtype for the whole flat parameter
    return model


def train(model, steps=5):
    torch.manual_seed(1)
    x, target = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(steps):
        loss = (model(x).float() - target.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rank_main(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp import StateDictType
    from anygpu.nn import Params4bit
    result = {}
    try:
        wrapped = FSDP(build(), use_orig_params=True, device_id=torch.device("cpu"),
                       sharding_strategy=ShardingStrategy.FULL_SHARD if world > 1 else ShardingStrategy.NO_SHARD)
        result["losses"] = train(wrapped)
        layers = [m.base_layer for m in wrapped.modules() if hasattr(m, "base_layer")]
        result["params4bit"] = all(type(m.weight) is Params4bit and m.weight.quant_state is m.quant_state
                                   for m in layers)
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            state_dict = wrapped.state_dict()
        x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            y = wrapped(x)  # every rank: the forward gathers the shards
        if rank == 0:
            fresh = build()
            fresh.load_state_dict(state_dict, strict=True)
            with torch.no_grad():
                result["reload_diff"] = (fresh(x) - y).abs().max().item()
            result["keys"] = sorted(k for k in state_dict if ".0.base_layer.weight" in k)
    except Exception:
        result["error"] = traceback.format_exc()
    if rank == 0 or "error" in result:
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, tmp = int(sys.argv[1]), sys.argv[2]
    reference = train(build())
    mp.spawn(rank_main, args=(world, f"{tmp}/store", f"{tmp}/out"), nprocs=world)
    results = {}
    for rank in range(world):
        if os.path.exists(f"{tmp}/out.{rank}"):
            results[rank] = json.load(open(f"{tmp}/out.{rank}"))
    print(json.dumps({"reference": reference, "ranks": results}))
'''


@pytest.mark.parametrize("world", [2])  # two ranks shard every flat parameter; one rank (also passing) adds no case
def test_fsdp_qlora_trains_as_without_fsdp_and_saves_a_loadable_state_dict(world, tmp_path):
    script = tmp_path / "fsdp_qlora.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(world), str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rank0 = result["ranks"]["0"]
    assert "error" not in rank0, rank0["error"]
    assert all("error" not in r for r in result["ranks"].values()), result["ranks"]
    assert rank0["params4bit"]  # FSDP kept the Params4bit objects and their quant_state
    assert rank0["losses"] == result["reference"]  # the same bf16 arithmetic, step for step
    assert rank0["losses"][-1] < rank0["losses"][0]
    assert rank0["reload_diff"] == 0.0
    prefix = "base_model.model.0.base_layer.weight"
    assert {f"{prefix}.absmax", f"{prefix}.quant_state.bitsandbytes__nf4", prefix} <= set(rank0["keys"])
