"""Name coverage of bitsandbytes, generated from both installed packages (tools/coverage_bnb.py): >= 90 % of
``bitsandbytes.optim`` and ``bitsandbytes.nn``, every name transformers / PEFT / accelerate use, covered names of
the right kind, and docs/guide/bitsandbytes-coverage.md current."""

import importlib.util
import inspect
import pathlib

import pytest
import torch

pytest.importorskip("bitsandbytes")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("coverage_bnb", ROOT / "tools" / "coverage_bnb.py")
coverage_bnb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_bnb)


@pytest.mark.parametrize("bnb_module,ours_module", [("bitsandbytes.optim", "anygpu.optim"),
                                                    ("bitsandbytes.nn", "anygpu.nn")])
def test_at_least_90_percent_of_optim_and_nn(bnb_module, ours_module):
    theirs, have = coverage_bnb.compare(bnb_module, ours_module)
    assert len(theirs) >= 10  # the listing found bitsandbytes' names at all
    assert len(have) / len(theirs) >= 0.9, sorted(set(theirs) - set(have))


def test_covered_names_are_the_same_kind_of_object():
    import anygpu.nn
    import anygpu.optim
    import bitsandbytes

    for sub, ours in (("optim", anygpu.optim), ("nn", anygpu.nn)):
        theirs = getattr(bitsandbytes, sub)
        for name in coverage_bnb.compare(f"bitsandbytes.{sub}", ours.__name__)[1]:
            a, b = getattr(ours, name), getattr(theirs, name)
            for base in (torch.optim.Optimizer, torch.nn.Module, torch.nn.Parameter):
                assert issubclass(a, base) == issubclass(b, base), name
            # the parameters bitsandbytes callers pass by name are accepted
            missing = set(inspect.signature(b.__init__).parameters) - set(inspect.signature(a.__init__).parameters)
            assert not missing, (name, missing)


def test_every_name_transformers_peft_and_accelerate_use_is_covered():
    import anygpu.nn
    import anygpu.optim
    import anygpu.quant.functional
    import bitsandbytes

    ours = {"nn": anygpu.nn, "optim": anygpu.optim, "functional": anygpu.quant.functional}
    used = coverage_bnb.consumer_names()
    assert used["nn"] and used["functional"]  # the scan found the uses (the packages are installed)
    current = {(sub, n) for sub, names in used.items() for n in names if hasattr(getattr(bitsandbytes, sub), n)}
    assert not [(sub, n) for sub, n in current if not hasattr(ours[sub], n)]


def test_the_guide_table_is_current():
    doc = (ROOT / "docs" / "guide" / "bitsandbytes-coverage.md").read_text()
    assert doc == coverage_bnb.table(), "regenerate: python tools/coverage_bnb.py > docs/guide/bitsandbytes-coverage.md"
