"""anygpu's kernels behind bitsandbytes' ops (anygpu/integrations/bitsandbytes.py), checked on the CPU.

Each check runs in a subprocess: the registration lasts for the process, and the other tests use bitsandbytes'
own CPU kernels as their oracle.  On the CPU anygpu's ops are the PyTorch references, which match bitsandbytes'
CPU backend bit for bit (test_quant_compat.py), so the outputs must not change at all once installed, while
``calls`` shows anygpu's kernels ran.  Importing the module installs for the CUDA device type only, so the CPU
checks call ``install(devices=("cpu",))``.  The GPU side (the point of the install) needs the device tool.

The ``bitsandbytes.backends`` entry point (bnb_backend.py) is checked through a plain ``import bitsandbytes`` in a
subprocess, with ``ANYGPU_BNB_BACKEND`` set by each test and removed otherwise; it exists only in the installed
metadata, which make's setup refreshes whenever pyproject.toml changes.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

from anygpu.integrations import bnb_backend

pytest.importorskip("bitsandbytes")

# bitsandbytes without its native library, as on a ROCm machine its wheel has no build for: every load fails, so
# cextension.py puts its ErrorHandlerMockBNBNativeLibrary in the library's place (on the CPU, as on GPUs)
NO_NATIVE = """
import ctypes, sys
_load = ctypes.cdll.LoadLibrary
def _no_bnb(path, *args, **kwargs):
    if "libbitsandbytes" in str(path):
        raise OSError(f"{path}: cannot open shared object file (simulated)")
    return _load(path, *args, **kwargs)
ctypes.cdll.LoadLibrary = _no_bnb
import bitsandbytes.cextension
assert type(bitsandbytes.cextension.lib).__name__ == "ErrorHandlerMockBNBNativeLibrary"
"""

LINEAR = """
import json, torch, bitsandbytes as bnb

def run():
    out = {}
    for qt in ("nf4", "fp4"):
        for nested in (False, True):
            torch.manual_seed(1)
            layer = bnb.nn.Linear4bit(128, 64, bias=True, quant_type=qt, compress_statistics=nested)
            layer = layer.to("cpu")  # quantizes through bitsandbytes::quantize_4bit (+ quantize_blockwise)
            x = torch.randn(2, 8, 128)
            out[f"{qt}-{nested}"] = [layer(x[:1, :1]), layer(x), layer.weight.data.clone()]
    return out

def run_int8():
    out = {}
    for thr in (0.0, 6.0):
        torch.manual_seed(2)
        layer = bnb.nn.Linear8bitLt(128, 64, bias=True, has_fp16_weights=False, threshold=thr).to("cpu")
        x = torch.randn(2, 8, 128, dtype=torch.float16) * 3  # some |x| >= 6: outlier columns
        with torch.no_grad():
            out[f"linear8-{thr}"] = [layer(x), layer.weight.data.clone()]
    gen = torch.Generator().manual_seed(3)
    A = torch.randint(-127, 128, (16, 96), dtype=torch.int8, generator=gen)
    B = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=gen)
    acc = torch.ops.bitsandbytes.int8_linear_matmul(A, B)
    rows, cols = torch.rand(16, generator=gen) + 0.5, torch.rand(48, generator=gen) + 0.5
    out["ops"] = [acc, torch.ops.bitsandbytes.int8_mm_dequant(acc, rows, cols, torch.float32, None)]
    return out

before, before8 = run(), run_int8()
import anygpu.integrations.bitsandbytes as agb
names = agb.install(devices=("cpu",))
after, after8 = run(), run_int8()
same = all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))
int8_diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for k in before8 for a, b in zip(before8[k], after8[k]))
print(json.dumps({"names": names, "same": same, "int8_diff": int8_diff, "calls": dict(agb.calls)}))
"""

IMPORT_ONLY = """
import json, torch, bitsandbytes
ops = ["quantize_4bit", "dequantize_4bit", "quantize_blockwise", "dequantize_blockwise", "gemv_4bit", "gemm_4bit",
       "int8_vectorwise_quant", "int8_linear_matmul", "int8_mm_dequant"]
def cuda_kernels():
    return [torch._C._dispatch_has_kernel_for_dispatch_key(f"bitsandbytes::{op}", "CUDA") for op in ops]
before = cuda_kernels()
import anygpu.integrations.bitsandbytes as agb
after, installed = cuda_kernels(), sorted(agb._installed)
again = agb.install()
print(json.dumps({"gpu": torch.cuda.is_available(), "before": before, "after": after, "installed": installed,
                  "again": again, "expected": sorted(f"bitsandbytes::{op}" for op in ops),
                  "installed_again": sorted(agb._installed) == installed}))
"""

TRANSFORMERS = """
import json, sys, warnings, torch, transformers, peft
if sys.argv[2] == "anygpu":
    import anygpu.integrations.bitsandbytes as agb
    agb.install(devices=("cpu",))
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=bnb_config,
                                                          device_map="cpu")
# bitsandbytes repacks 4-bit weights into its own CPU layout on an eval-mode forward (AVX512-BF16 machines),
# which neither anygpu nor bitsandbytes' own dequantize_4bit (PEFT's merge) reads: stay in train mode (Llama has
# no dropout, so the outputs are the same)
model.train()
quantized = type(model.model.layers[0].self_attn.q_proj).__name__
ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
generated = model.generate(ids, max_new_tokens=4, do_sample=False)
model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0, task_type="CAUSAL_LM"))
opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
losses = []
for _ in range(8):
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
with torch.no_grad():
    unmerged = model(input_ids=ids).logits
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # PEFT warns that a 4-bit merge rounds
    merged = model.merge_and_unload()
with torch.no_grad():
    out = merged(input_ids=ids).logits
print(json.dumps({"quantized": quantized, "generated": list(generated.shape), "losses": losses,
                  "merge_rel": ((out - unmerged).norm() / unmerged.norm()).item(),
                  "calls": dict(agb.calls) if sys.argv[2] == "anygpu" else {}}))
"""


def _run(script: str, *args, env: dict | None = None, flags: tuple = ()) -> dict:
    # the entry point's variable comes only from `env`: one set in the caller's shell would change what
    # `import bitsandbytes` installs in every script here
    environ = {k: v for k, v in os.environ.items() if k != bnb_backend.ENV_VAR} | (env or {})
    done = subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(script), *args], capture_output=True,
                          text=True, timeout=600, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def test_the_import_alone_registers_anygpu_for_gpus_once():
    result = _run(IMPORT_ONLY)
    assert all(result["after"])
    if not result["gpu"]:
        assert not any(result["before"])  # bitsandbytes registers its CUDA kernels only where CUDA is available
    assert result["installed"] == [[name, "cuda"] for name in result["expected"]]
    assert result["again"] == result["expected"] and result["installed_again"]  # idempotent


@pytest.mark.parametrize("native", ["native", "no-native"])
def test_bitsandbytes_linear4bit_runs_on_anygpu_kernels_with_identical_results(native):
    """Also without bitsandbytes' native library: its mock library defers the load error to a native call, and
    anygpu's registrations still take over (on the CPU here; on a ROCm GPU the same holds for "cuda")."""
    result = _run((NO_NATIVE if native == "no-native" else "") + LINEAR)
    assert "bitsandbytes::gemm_4bit" in result["names"] and "bitsandbytes::dequantize_4bit" in result["names"]
    assert result["same"]
    calls = result["calls"]
    assert calls.get("quantize_4bit", 0) == 4  # each layer quantized by anygpu
    assert calls.get("quantize_blockwise", 0) == 2  # the two nested layers' absmax
    assert calls.get("gemm_4bit", 0) + calls.get("gemv_4bit", 0) + calls.get("dequantize_4bit", 0) >= 8
    # int8: bitsandbytes' Linear8bitLt quantizes its weight through the op (its CPU forward dequantizes, so the
    # matmul ops are checked directly); anygpu's int8 reference is bitsandbytes' to float rounding
    assert result["int8_diff"] < 2 ** -11  # at most an fp16 rounding step of the largest output
    assert calls.get("int8_vectorwise_quant", 0) >= 2
    assert calls.get("int8_linear_matmul", 0) == 1 and calls.get("int8_mm_dequant", 0) == 1


def test_transformers_4bit_load_generate_qlora_and_merge_on_anygpu_kernels(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    result = _run(TRANSFORMERS, str(tmp_path / "tiny"), "anygpu")
    own = _run(TRANSFORMERS, str(tmp_path / "tiny-bnb"), "bitsandbytes")  # bitsandbytes' own CPU kernels
    assert not own["calls"]
    # the same training run, step for step, within float rounding of the kernels' summation order
    assert result["losses"] == pytest.approx(own["losses"], rel=1e-3)
    assert result["quantized"] == "Linear4bit"
    assert result["generated"] == [2, 16]
    assert result["losses"][-1] < result["losses"][0]
    assert result["merge_rel"] < 0.1  # the merged model is the adapted one, up to one requantization
    calls = result["calls"]
    assert calls.get("quantize_4bit", 0) >= 14  # 7 linears per layer x 2 layers at load (and more at merge)
    assert calls.get("dequantize_4bit", 0) >= 4  # PEFT's merge dequantizes q_proj and v_proj in both layers
    assert calls.get("gemm_4bit", 0) + calls.get("gemv_4bit", 0) > 0


# -- the bitsandbytes.backends entry point (anygpu/integrations/bnb_backend.py): `import bitsandbytes` alone --

# A plain `import bitsandbytes`, then a 4-bit round trip through bitsandbytes' own functional API; what anygpu
# installed is read from bnb_kernels (anygpu.integrations.bitsandbytes would install for "cuda" on import)
BNB_ONLY = """
import json, sys, torch
import bitsandbytes
import bitsandbytes.functional as F
loaded = sorted(m for m in sys.modules if m.startswith("anygpu"))
A = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
packed, state = F.quantize_4bit(A, blocksize=64, quant_type="nf4")
back = F.dequantize_4bit(packed, state)
kernels = sys.modules.get("anygpu.integrations.bnb_kernels")
cext = sys.modules["bitsandbytes.cextension"]
print(json.dumps({"loaded": loaded, "calls": dict(kernels.calls) if kernels else None,
                  "installed": sorted(d for _, d in kernels._installed) if kernels else [],
                  "cuda_kernel": torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::dequantize_4bit",
                                                                                 "CUDA"),
                  "gpu": torch.cuda.is_available(), "gpu_library": bool(cext.lib.compiled_with_cuda),
                  "err": ((back - A).norm() / A.norm()).item()}))
"""


def test_the_entry_point_is_in_the_installed_metadata():
    """bitsandbytes finds it only through the installed distribution's metadata: a checkout installed before the
    entry point was declared needs `pip install -e . --no-deps` again (make's setup redoes it when pyproject.toml
    changes)."""
    found = [ep for ep in importlib.metadata.entry_points(group="bitsandbytes.backends") if ep.name == "anygpu"]
    assert found, "reinstall anygpu (pip install -e . --no-deps): its bitsandbytes.backends entry point is missing"
    assert found[0].value == "anygpu.integrations.bnb_backend:entry_point"
    assert found[0].load() is bnb_backend.entry_point


@pytest.mark.parametrize("value,gpu,library,expected", [
    (None, False, False, ()), ("", True, True, ()), ("auto", True, True, ()),
    (None, True, False, ("cuda",)),  # a GPU, and bitsandbytes without a GPU library: the only automatic case
    (" AUTO ", False, False, ()),
    ("0", True, False, ()), ("off", True, False, ()), ("false", True, False, ()), ("no", True, False, ()),
    ("1", True, True, ("cuda",)), ("on", False, True, ("cuda",)), ("true", True, True, ("cuda",)),
    ("cpu", True, True, ("cpu",)), ("cuda,cpu", False, False, ("cuda", "cpu")), ("cpu, cpu", False, False, ("cpu",)),
])
def test_choose_devices(value, gpu, library, expected):
    assert bnb_backend.choose_devices(value, gpu, library) == expected


@pytest.mark.parametrize("value", ["2", "nvidia", "cuda,rocm", ",", "cpu;cuda"])
def test_choose_devices_rejects_unknown_values_naming_the_variable(value):
    with pytest.raises(ValueError, match="ANYGPU_BNB_BACKEND.*expected auto, 0, 1"):
        bnb_backend.choose_devices(value, True, False)


def test_import_bitsandbytes_by_default_leaves_a_working_bitsandbytes_alone():
    """The default (auto) acts only where a GPU has no bitsandbytes GPU library.  Elsewhere the entry point runs
    (bnb_backend is loaded) and imports nothing else of anygpu: no kernels, no registrations."""
    result = _run(BNB_ONLY)
    assert "anygpu.integrations.bnb_backend" in result["loaded"]  # bitsandbytes called it
    if result["gpu"] and not result["gpu_library"]:
        assert result["installed"] == ["cuda"] * 9  # a GPU bitsandbytes has no library for: taken over
    else:
        heavy = ("anygpu.ops", "anygpu.kernels", "anygpu.quant", "anygpu.nn", "anygpu.engine",
                 "anygpu.integrations.bnb_kernels", "anygpu.integrations.bitsandbytes")
        assert not [m for m in result["loaded"] if m.startswith(heavy)]
        assert result["calls"] is None
        assert result["cuda_kernel"] == result["gpu"]  # bitsandbytes' own, only where it registered one


def test_import_bitsandbytes_alone_routes_its_ops_to_anygpu_when_asked():
    """ANYGPU_BNB_BACKEND=cpu: bitsandbytes' own quantize / dequantize calls run on anygpu's kernels, with no
    anygpu line in the program, and only the CPU is taken (not the GPUs as well)."""
    result = _run(BNB_ONLY, env={"ANYGPU_BNB_BACKEND": "cpu"})
    assert result["calls"] == {"quantize_4bit": 1, "dequantize_4bit": 1}
    assert set(result["installed"]) == {"cpu"}
    assert "anygpu.integrations.bitsandbytes" not in result["loaded"]
    assert result["err"] < 0.15  # a real NF4 round trip (relative error about 0.1)


@pytest.mark.parametrize("value", ["1", "cuda,cpu"])
def test_the_variable_forces_the_gpu_install(value):
    """=1 takes the GPUs over even where bitsandbytes' library works (on this CPU-only machine, torch registers
    the CUDA kernels all the same: the dispatcher has the key without a device)."""
    result = _run(BNB_ONLY, env={"ANYGPU_BNB_BACKEND": value})
    assert result["cuda_kernel"]
    assert result["installed"].count("cuda") == 9  # every op, gemv_4bit included
    assert result["installed"].count("cpu") == (8 if "cpu" in value else 0)  # gemv_4bit stays bitsandbytes'


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_opt_out_installs_nothing(value):
    result = _run(NO_NATIVE + BNB_ONLY, env={"ANYGPU_BNB_BACKEND": value})
    assert "anygpu.integrations.bnb_kernels" not in result["loaded"]
    assert result["calls"] is None and result["installed"] == []


def test_an_unknown_value_is_logged_and_the_import_works():
    result = _run(BNB_ONLY, env={"ANYGPU_BNB_BACKEND": "yes-please"})
    assert "ANYGPU_BNB_BACKEND: expected auto, 0, 1" in result["stderr"] and "using auto" in result["stderr"]
    assert "calls" in result  # the import and the round trip ran


def test_the_entry_point_never_fails_the_import():
    """A failing install (here: bitsandbytes blocked from importing, as a broken install would be) is logged and
    the entry point returns; under `-W error` the install's override warnings would be exceptions, and are not."""
    blocked = """
import json, sys
sys.modules["bitsandbytes"] = None  # `import bitsandbytes` now raises ImportError
from anygpu.integrations import bnb_backend
print(json.dumps({"returned": bnb_backend.entry_point()}))
"""
    result = _run(blocked, env={"ANYGPU_BNB_BACKEND": "cpu"})
    assert result["returned"] is None
    assert "entry point failed" in result["stderr"] and "needs bitsandbytes" in result["stderr"]
    strict = _run(BNB_ONLY, env={"ANYGPU_BNB_BACKEND": "cuda,cpu"}, flags=("-W", "error"))
    assert strict["calls"] == {"quantize_4bit": 1, "dequantize_4bit": 1}


def test_importing_anygpu_first_then_bitsandbytes_through_it():
    """The other import order: anygpu.integrations.bitsandbytes imports bitsandbytes inside its install(), and
    bitsandbytes calls the entry point while that install is under way; both installs take, each once."""
    script = """
import json, sys
import anygpu.integrations.bitsandbytes as agb
import bitsandbytes.functional as F, torch
packed, state = F.quantize_4bit(torch.randn(64, 64), quant_type="fp4")
print(json.dumps({"installed": sorted(d for _, d in agb._installed), "calls": dict(agb.calls),
                  "loaded": sorted(m for m in sys.modules if m.startswith("anygpu"))}))
"""
    result = _run(script, env={"ANYGPU_BNB_BACKEND": "cpu"})
    assert result["installed"].count("cuda") == 9 and result["installed"].count("cpu") == 8
    assert result["calls"] == {"quantize_4bit": 1}
    assert "anygpu.integrations.bnb_backend" in result["loaded"]
