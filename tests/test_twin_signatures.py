"""Every Pallas kernel has a pure-JAX twin with the same signature: each kernel's parameters (names, kinds,
defaults) are its twin's, so a call made for one can be sent unchanged to the other. ``tree_attention_ref`` also
takes ``chunk`` (its own memory bound) and ignores tuning it does not know, and the narrow kernel takes a subset of
``split_attention``'s keywords, all of them the twin's."""

import inspect

import pytest

from pallas_kernels import int4_moe, int4_moe_fused, int4_moe_mgpu, mla_attention_mgpu, split_combine
from pallas_kernels.mla_attention_narrow import split_attention_narrow
from pallas_kernels.tree_attention import tree_attention, tree_attention_ref

PAIRS = [
    (split_combine.combine_splits, split_combine.combine_splits_ref),
    (mla_attention_mgpu.split_attention, mla_attention_mgpu.split_attention_ref),
    (int4_moe_mgpu.grouped_int4_matmul, int4_moe_mgpu.grouped_int4_matmul_ref),
    (int4_moe.int4_moe, int4_moe.int4_moe_ref),
    (int4_moe_fused.fused_int4_moe, int4_moe_fused.fused_int4_moe_ref),
]


def parameters(fn):
    return {name: (p.kind, p.default) for name, p in inspect.signature(fn).parameters.items()}


@pytest.mark.parametrize("kernel,twin", PAIRS, ids=[k.__name__ for k, _ in PAIRS])
def test_twin_has_the_kernels_signature(kernel, twin):
    assert list(parameters(twin)) == list(parameters(kernel))
    assert parameters(twin) == parameters(kernel)


def test_twins_that_take_more_take_all_of_their_kernels_parameters():
    twin = parameters(mla_attention_mgpu.split_attention_ref)
    for name, spec in parameters(split_attention_narrow).items():
        assert twin.get(name) == spec, name
    twin = parameters(tree_attention_ref)
    for name, (kind, default) in parameters(tree_attention).items():
        assert name in twin or any(k == inspect.Parameter.VAR_KEYWORD for k, _ in twin.values()), name
        if name in twin and default is not None:
            assert twin[name] == (kind, default), name
