"""FSDP2's own policy classes passed to our ``fully_shard`` (issue 37, item 4): torch's
``MixedPrecisionPolicy`` means what ours means (before: refused as "mp_policy must be a
MixedPrecisionPolicy or None, got MixedPrecisionPolicy"); ``OffloadPolicy()`` (no offload) is accepted
and ``CPUOffloadPolicy`` refused, naming it and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import fsdp as torch_fsdp

import fsdp_optim
from fsdp_optim._testing import DistributedTestError, run_distributed
from fsdp_optim.optimizers import adamw_rule
from fsdp_optim.sharding._mixed_precision import as_mp_policy

from .test_fully_shard import _batches, _full_grads, _local, _loss, _new_model, _shard


def test_torch_policy_maps_to_ours_with_fsdp2s_meaning():
    bf16, fp32 = torch.bfloat16, torch.float32
    ours = fsdp_optim.MixedPrecisionPolicy
    assert as_mp_policy(torch_fsdp.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32,
                                                        cast_forward_inputs=False)) == ours(
        param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32, cast_forward_inputs=False)
    # FSDP2 reduces in param_dtype when reduce_dtype is unset (ours would use the master dtype): kept so
    assert as_mp_policy(torch_fsdp.MixedPrecisionPolicy(param_dtype=bf16)) == ours(param_dtype=bf16, reduce_dtype=bf16)
    assert as_mp_policy(torch_fsdp.MixedPrecisionPolicy()) == ours()
    mine = ours(param_dtype=bf16)
    assert as_mp_policy(mine) is mine and as_mp_policy(None) is None


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_torch_policy_trains_as_ours(reduce_dtype):
    """W = 2, bf16 compute: torch's policy and ours with the same meaning give the same gradients, bitwise,
    and the same compute dtypes."""
    x, y = _batches(1)[0]

    def fn():
        w, r = dist.get_world_size(), dist.get_rank()
        out = []
        for mp in (torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype),
                   fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=reduce_dtype or torch.bfloat16)):
            model = _shard(_new_model(), adamw_rule, mp=mp)
            seen = []
            model.layers[0].attn.wq.register_forward_hook(lambda m, a, o: seen.append((m.weight.dtype, o.dtype)))
            _loss(model, _local(x, w, r), _local(y, w, r)).backward()
            out.append((seen, _full_grads(model)))
        return out

    for (seen_t, grads_t), (seen_o, grads_o) in run_distributed(fn, world_size=2):
        assert seen_t == seen_o == [(torch.bfloat16, torch.bfloat16)]
        assert grads_t.keys() == grads_o.keys() and all(torch.equal(grads_t[k], grads_o[k]) for k in grads_o)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"param_dtype": torch.int8},
         r"mp_policy=torch\.distributed\.fsdp\.MixedPrecisionPolicy\(param_dtype=torch\.int8\): fsdp_optim computes, "
         r"reduces and outputs in floating-point dtypes only; use a floating-point dtype"),
        ({"reduce_dtype": torch.int32}, r"MixedPrecisionPolicy\(reduce_dtype=torch\.int32\)"),
        ({"output_dtype": torch.bool}, r"MixedPrecisionPolicy\(output_dtype=torch\.bool\)"),
        ({"cast_forward_inputs": 1}, r"MixedPrecisionPolicy\(cast_forward_inputs=1\): it must be True or False"),
    ],
)
def test_a_torch_policy_value_we_cannot_honour_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fsdp_optim.fully_shard(_new_model(), mp_policy=torch_fsdp.MixedPrecisionPolicy(**kwargs))


def test_a_wrong_mp_policy_names_both_classes_apart():
    with pytest.raises(ValueError) as info:
        fsdp_optim.fully_shard(_new_model(), mp_policy=torch.bfloat16)
    assert str(info.value) == ("mp_policy must be a fsdp_optim.MixedPrecisionPolicy, a "
                               "torch.distributed.fsdp.MixedPrecisionPolicy or None, got torch.dtype")
    with pytest.raises(ValueError, match=r"^fsdp_optim\.MixedPrecisionPolicy\.param_dtype must be a floating-point"):
        fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.int8)


def test_offload_policy_none_or_no_offload_is_accepted_cpu_offload_refused():
    def fn():  # (in a process group: fully_shard may need one even for a single rank)
        fsdp_optim.fully_shard(_new_model(), offload_policy=torch_fsdp.OffloadPolicy())
        fsdp_optim.fully_shard(_new_model(), offload_policy=None)
        model = _new_model()
        with pytest.raises(ValueError, match=r"^offload_policy=torch\.distributed\.fsdp\.CPUOffloadPolicy\(pin_memory=True\): "
                                             r"fsdp_optim does not offload to CPU .*drop offload_policy, or pass "
                                             r"torch\.distributed\.fsdp\.OffloadPolicy\(\) \(no offload\)$"):
            fsdp_optim.fully_shard(model, offload_policy=torch_fsdp.CPUOffloadPolicy())
        fsdp_optim.fully_shard(model)  # the refused call left no trace
        with pytest.raises(ValueError, match=r"^offload_policy must be None or torch\.distributed\.fsdp\.OffloadPolicy\(\)"):
            fsdp_optim.fully_shard(_new_model(), offload_policy="cpu")

    run_distributed(fn, world_size=1)


def test_refusals_raise_on_every_rank():
    def fn():
        fsdp_optim.fully_shard(_new_model(), offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False))

    with pytest.raises(DistributedTestError) as info:
        run_distributed(fn, world_size=2)
    assert "ranks with errors: [0, 1]" in str(info.value)
    assert "CPUOffloadPolicy(pin_memory=False): fsdp_optim does not offload to CPU" in str(info.value)
