"""Gram Newton–Schulz and Polar Express (fsdp_optim.optimizers._orthogonalize, Muon's ``orthogonalize``
and ``coefficients``) against their authors' code: gram-newton-schulz 0.1.6 (Dao AI Lab; its
pure-torch backend, ``ns_use_kernels=False, compile_kwargs=None``; scripts/setup.sh installs it
with ``--no-deps``) and torch.optim.Muon with its Newton–Schulz replaced by the authors' function.

On the same bf16 input, in fp16 with the same restarts, ours gives the authors' bits for wide and
square matrices; for tall ones (transposed here, not there) the tolerance is measured: the authors'
own distance from the same polynomial evaluated in float64 (``floor``).
"""

from __future__ import annotations

import gram_newton_schulz as gns  # the reference: an import error is a failure, never a skip
import pytest
import torch
import torch.optim._muon as torch_muon
from torch.utils.flop_counter import FlopCounterMode

from fsdp_optim.optimizers import Muon
from fsdp_optim.optimizers._orthogonalize import (
    _POLAR_EXPRESS_UNSCALED, DEFAULT_NS_COEFFICIENTS, POLAR_EXPRESS, flops, gram_newton_schulz, newton_schulz,
    schedule,
)  # fmt: skip
from tests.optimizers.test_muon import (
    MATRICES, SHAPES, _init, _one_thread, _specs, _split_case, assert_bitwise, owner_layout, reference, run_sharded,
    uneven_layout,
)  # fmt: skip

TORCH = schedule(DEFAULT_NS_COEFFICIENTS)


def _authors(coefficients, *, gram: bool = True, restarts=(2,), eps: float = 1e-7):
    cls = dict(use_gram_newton_schulz=gram, gram_newton_schulz_reset_iterations=list(restarts)) if gram else {}
    return gns.GramNewtonSchulz(ns_epsilon=eps, ns_use_kernels=False, ns_coefficients=[list(c) for c in coefficients],
                                compile_kwargs=None, **cls)  # fmt: skip


def _exact(g: torch.Tensor, coefficients) -> torch.Tensor:
    """The polynomial of ``coefficients`` in float64 (the authors' normalization): what both roundings approximate."""
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in coefficients:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- coefficients ------------------------------------------------------------------------------
def test_polar_express_coefficients_are_the_published_ones():
    # the authors' package, bit for bit (same values, same safety factor 1.05, same float ops)
    assert POLAR_EXPRESS == tuple(tuple(c) for c in gns.POLAR_EXPRESS_COEFFICIENTS)
    # the paper's Algorithm 1 (arXiv:2505.16932) divides the same polynomials by 1.01 (a / s, b / s^3, c / s^5);
    # NVIDIA Emerging-Optimizers' "polar_express" set (muon_utils.py) prints that, to 4 decimals (truncated or rounded)
    emerging = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985)]  # fmt: skip
    for (a, b, c), want in zip(_POLAR_EXPRESS_UNSCALED, emerging, strict=True):
        assert (a / 1.01, b / 1.01**3, c / 1.01**5) == pytest.approx(want, abs=1e-4)
    # "torch" is torch.optim.Muon's (Keller Jordan's) set
    assert DEFAULT_NS_COEFFICIENTS == (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)


# ---- the pure functions against the authors' code ---------------------------------------------------
SHAPES_GRAM = [(64, 224), (224, 64), (3, 48, 170), (3, 170, 48), (33, 65), (2, 256, 1024)]


@pytest.mark.parametrize("coefficients", [POLAR_EXPRESS, TORCH], ids=["polar_express", "torch"])
@pytest.mark.parametrize("restarts", [(2,), (), (1, 3)], ids=["restart2", "norestart", "restart13"])
@pytest.mark.parametrize("shape", SHAPES_GRAM, ids=str)
def test_gram_newton_schulz_equals_the_authors_within_their_precision(shape, restarts, coefficients):
    """Same bf16 input, fp16, same restarts. Wide matrices: the authors' bits. Tall ones (we transpose,
    they iterate on X^T X and multiply on the right; their Q is symmetric only to rounding): within
    1.5 x their own distance from exact arithmetic (measured: at most 1.10 x; ours as close to exact
    as theirs within 1.16 x)."""
    torch.manual_seed(sum(shape))
    g = torch.randn(shape).bfloat16()
    with _one_thread():
        ours = gram_newton_schulz(g, coefficients=coefficients, restarts=restarts)
        theirs = _authors(coefficients, restarts=restarts)(g)  # bf16 in, bf16 out
    assert ours.dtype == torch.bfloat16 and ours.shape == g.shape
    if shape[-2] <= shape[-1]:
        assert torch.equal(ours, theirs)
        return
    exact = _exact(g, coefficients)
    floor = _rel(theirs, exact)  # their distance from the same polynomial in float64
    assert _rel(ours, theirs) <= 1.5 * floor, (_rel(ours, theirs), floor)
    assert _rel(ours, exact) <= 1.5 * floor, (_rel(ours, exact), floor)
    assert floor < 1e-2  # (a rounding floor, not a different polynomial)


@pytest.mark.parametrize("shape", [(48, 48), (3, 64, 64)], ids=str)
def test_square_matrices_run_the_plain_iteration_as_the_authors(shape):
    """No Gram saving on a square matrix: the authors run the plain iteration there (fp16), and so do we, bitwise."""
    g = torch.randn(shape).bfloat16()
    with _one_thread():
        assert torch.equal(gram_newton_schulz(g, coefficients=POLAR_EXPRESS), _authors(POLAR_EXPRESS)(g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gram_leaves_its_input_alone(dtype):
    """(The bf16 path normalizes in place, on its own copy, also when the input is already bf16.)"""
    for g in (torch.randn(3, 40, 90).bfloat16(), torch.randn(90, 40)):
        before = g.clone()
        out = gram_newton_schulz(g, coefficients=POLAR_EXPRESS, dtype=dtype)
        assert torch.equal(g, before) and out.dtype == torch.bfloat16 and out.shape == g.shape


def test_polar_express_newton_schulz_applies_the_published_coefficients():
    """``newton_schulz`` (bf16, torch's ops) with Polar Express is the authors' plain iteration with their
    coefficients, to bf16's precision: no farther from theirs than torch.optim.Muon's own Newton–Schulz is
    from the authors' plain iteration with torch's coefficients (the bf16 vs fp16 floor)."""
    torch.manual_seed(0)
    g = torch.randn(4, 96, 320)
    with _one_thread():
        ours = newton_schulz(g, coefficients=POLAR_EXPRESS)
        theirs = _authors(POLAR_EXPRESS, gram=False)(g.bfloat16().float())
        torch_ns = torch.stack([torch_muon._zeropower_via_newtonschulz(m, DEFAULT_NS_COEFFICIENTS, 5, 1e-7) for m in g])
        floor = _rel(torch_ns, _authors(TORCH, gram=False)(g.bfloat16().float()))
    assert _rel(ours, theirs) <= 1.5 * floor, (_rel(ours, theirs), floor)
    assert _rel(ours, _exact(g.bfloat16(), POLAR_EXPRESS)) <= 1.5 * floor


def test_flops_count_what_runs():
    """``flops`` against torch's FlopCounterMode on the functions themselves (the benchmark prints it)."""
    for rows, cols in [(64, 224), (224, 64), (64, 64), (40, 140)]:
        for fn, method in [(newton_schulz, "newton_schulz"), (gram_newton_schulz, "gram_newton_schulz")]:
            for sched in (TORCH, POLAR_EXPRESS[:3]):
                with FlopCounterMode(display=False) as counter:
                    fn(torch.randn(2, rows, cols), coefficients=sched)
                assert counter.get_total_flops() == 2 * flops(method, rows, cols, len(sched)), (rows, cols, method)
    n = 512
    assert flops("gram_newton_schulz", n, 7 * n // 2, 5) / flops("newton_schulz", n, 7 * n // 2, 5) == 56 / 80


# ---- Muon ---------------------------------------------------------------------------------------
def test_muon_arguments_are_validated_naming_the_argument_and_the_choices():
    w = [("w", torch.nn.Parameter(torch.randn(6, 4)))]
    with pytest.raises(ValueError, match=r"orthogonalize must be one of \('newton_schulz', 'gram_newton_schulz'\), got 'gram'"):
        Muon(w, orthogonalize="gram")
    with pytest.raises(ValueError, match=r"coefficients must be one of \('torch', 'polar_express'\) or a list.*'polar'"):
        Muon(w, coefficients="polar")
    with pytest.raises(ValueError, match=r"coefficients: each iteration's entry must be three finite numbers"):
        Muon(w, coefficients=[(1.0, 2.0)])
    with pytest.raises(ValueError, match=r"coefficients: each iteration's entry must be three finite numbers"):
        Muon(w, coefficients=[(1.0, float("nan"), 2.0)])
    with pytest.raises(ValueError, match=r"coefficients: a list needs 1 to 99"):
        Muon(w, coefficients=[])
    with pytest.raises(ValueError, match=r"ns_coefficients=.*applies only with coefficients='torch'; coefficients='polar_express' sets"):
        Muon(w, coefficients="polar_express", ns_coefficients=(3.0, -3.0, 1.0))
    with pytest.raises(ValueError, match=r"ns_steps=3 but coefficients give 5 iterations"):
        Muon(w, coefficients="polar_express", ns_steps=3)
    with pytest.raises(ValueError, match=r"gram_dtype must be one of"):
        Muon(w, orthogonalize="gram_newton_schulz", gram_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"orthogonalize must be one of"):  # a group's own setting too
        Muon([{"params": w, "orthogonalize": "svd"}])
    # a list of the right length with ns_steps at its default, or equal to it: fine; tuples or lists
    opt = Muon([{"params": w, "coefficients": [[3.0, -3.2, 1.2]] * 3}], coefficients=list(POLAR_EXPRESS[:2]))
    assert opt.param_groups[0]["coefficients"] == [[3.0, -3.2, 1.2]] * 3
    assert opt.defaults["coefficients"] == POLAR_EXPRESS[:2] and opt.defaults["orthogonalize"] == "newton_schulz"
    Muon(w, coefficients=POLAR_EXPRESS[:3], ns_steps=3)


@pytest.fixture
def authors_orthogonalization(monkeypatch):
    """torch.optim.Muon with its Newton–Schulz replaced by the authors' function on the bf16 update."""

    def use(fn):
        monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda g, *_: fn(g.bfloat16()))

    return use


SETTINGS = {
    "gram-torch": (dict(orthogonalize="gram_newton_schulz"), lambda: _authors(TORCH)),
    "gram-polar_express": (dict(orthogonalize="gram_newton_schulz", coefficients="polar_express"),
                           lambda: _authors(POLAR_EXPRESS)),
    "ns-polar_express": (dict(coefficients="polar_express"), lambda: _authors(POLAR_EXPRESS, gram=False)),
}  # fmt: skip


def _max_rel(ours, ref, names):
    return max(((ours[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in names)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_muon_equals_torch_muon_with_the_authors_orthogonalization(setting, authors_orthogonalization):
    """One process, STEPS steps: ours vs torch.optim.Muon (+ AdamW) whose Newton–Schulz is the authors'
    function. Tolerance: twice the distance between torch.optim.Muon as it is and torch.optim.Muon with
    the authors' plain fp16 iteration (torch's coefficients), measured on the same run: 3.1e-4 of the
    largest weight; measured distances: gram-torch 4.5e-5, gram-polar_express 1.2e-4 (the tall matrices;
    the wide ones are the authors' bits), ns-polar_express 4.5e-4 (bf16 against their fp16)."""
    kw, theirs = SETTINGS[setting]
    init, specs = _init(SHAPES), _specs(SHAPES)
    layouts = {k: owner_layout(s, 1, 0) for k, s in SHAPES.items()}
    common = dict(weight_decay=0.1, nesterov=True, adjust_lr_fn="original")
    [(ours, counts)] = run_sharded(init, SHAPES, specs, layouts, set(), {}, world_size=1, configs=[{**common, **kw}])
    torch_ref = reference(init, SHAPES, MATRICES, **common)
    authors_orthogonalization(_authors(TORCH, gram=False))
    floor = _max_rel(torch_ref, reference(init, SHAPES, MATRICES, **common), MATRICES)
    authors_orthogonalization(theirs())
    ref = reference(init, SHAPES, MATRICES, **common)
    assert 0 < _max_rel(ours, ref, MATRICES) <= 2 * floor, (_max_rel(ours, ref, MATRICES), floor)
    rest = [k for k in SHAPES if k not in MATRICES]
    assert_bitwise({k: ours[k] for k in rest}, {k: ref[k] for k in rest})  # the AdamW part is untouched
    if setting != "ns-polar_express":  # a different polynomial: farther from torch's than the roundings
        return
    assert _max_rel(ours, torch_ref, MATRICES) > 3 * floor


SHARDED_CONFIGS = [
    dict(orthogonalize="gram_newton_schulz"),
    dict(orthogonalize="gram_newton_schulz", coefficients="polar_express", gram_dtype=torch.bfloat16),
    dict(coefficients="polar_express", batched=False),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_equals_one_process_bitwise_with_zero_collectives(world_size):
    """Whole matrices spread over the ranks: the same bits as one process, no collective in step()."""
    init, specs = _init(SHAPES), _specs(SHAPES)
    results = {}
    for w in (1, world_size):
        layouts = {k: owner_layout(s, w, i % w) if specs[k].is_matrix else uneven_layout(s, w)
                   for i, (k, s) in enumerate(SHAPES.items())}  # fmt: skip
        results[w] = run_sharded(init, SHAPES, specs, layouts, set(), {}, world_size=w, configs=SHARDED_CONFIGS)
    for (one, _), (ours, counts) in zip(results[1], results[world_size]):
        assert_bitwise(ours, one)
        assert all(c == {} for per_rank in counts for c in per_rank), counts


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_split_matrices_equal_one_process_bitwise(world_size):
    """Matrices cut across ranks go to their owner as bf16, which is what both methods read: exact."""
    shapes, buckets, specs, layouts, splits = _split_case(world_size)
    one = {k: owner_layout(s, 1, 0) for k, s in shapes.items()}
    init = _init(shapes)
    want = run_sharded(init, shapes, specs, one, set(), {}, world_size=1, configs=SHARDED_CONFIGS)
    got = run_sharded(init, shapes, specs, layouts, splits, buckets, world_size=world_size, configs=SHARDED_CONFIGS)
    for (ref, _), (ours, counts) in zip(want, got):
        assert_bitwise(ours, ref)
        assert all(c == {"c10d.alltoall_base_": 2} for per_rank in counts for c in per_rank), counts


def test_muon_state_dict_keeps_the_settings():
    w = torch.randn(6, 4)
    opt = Muon([("w", torch.nn.Parameter(w))], orthogonalize="gram_newton_schulz", coefficients="polar_express")
    opt2 = Muon([("w", torch.nn.Parameter(w.clone()))])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["orthogonalize"] == "gram_newton_schulz"
    assert opt2.param_groups[0]["coefficients"] == "polar_express"
