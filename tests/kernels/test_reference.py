"""smelt_kernels.reference holds every op's pure-torch reference: each op the registry holds
has a ``"torch"`` implementation whose forward and backward are named there, and every
feature with an ``ops.py`` is one the registry loads (so a new op cannot be missed)."""

import pathlib

import pytest

from smelt_kernels import backends, reference

PACKAGE = pathlib.Path(backends.__file__).parent
EXPORTED = {id(getattr(reference, name)) for name in reference.__all__}


def _ops():
    return sorted(backends.report("cpu"))  # report() imports every module of OP_MODULES


def test_every_feature_is_loaded_by_the_registry():
    features = {p.parent.name for p in PACKAGE.glob("*/ops.py")}
    assert {f"smelt_kernels.{f}" for f in features} == set(backends.OP_MODULES)


def test_every_name_is_a_function_of_a_reference_module():
    for name in reference.__all__:
        fn = getattr(reference, name)
        assert callable(fn), name
        module = fn.__module__
        assert module.endswith(".reference") or module == "smelt_kernels.moe_gemm.loss", name


@pytest.mark.parametrize("op", _ops())
def test_every_registered_op_has_its_reference_here(op):
    impl = backends.implementation(op, "torch")
    assert id(impl.forward) in EXPORTED, f"{op}: {impl.forward.__qualname__} not in reference"
    if impl.backward is not None:
        assert id(impl.backward) in EXPORTED, f"{op}: {impl.backward.__qualname__} not in reference"


def test_router_loss_is_here():
    assert reference.router_loss.__module__ == "smelt_kernels.moe_gemm.loss"
