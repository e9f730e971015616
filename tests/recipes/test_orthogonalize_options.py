"""Issue #36 in the recipe: ``optim.orthogonalize``, ``optim.coefficients``, ``optim.gram_dtype`` and
``--optimizer normuon`` (``optim.normuon_beta2``, ``optim.normuon_eps``).

Bad values are refused as the config is read, naming the key, the value and the allowed values;
settings that would do nothing (an option of another optimizer) or that the torch backend cannot run
are refused before any rank starts; each option reaches the optimizer the recipe builds, and short
2-rank runs with each train (finite loss) and train differently from the default Muon.
"""

import json
import subprocess
import sys

import pytest
import torch

import config
from _backend import GRAM_DTYPES, build_optimizer, describe_optimizer, shard_model
from _checkpointing import check_resume_config
from _checks import parse_args, resolve_config
from config import check_ranges, load_config, to_dict
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon, NorMuon

from .test_pretrain import CONFIGS, SCRIPT, check_outputs, train

TINY = CONFIGS / "tiny.toml"
THREE_TRIPLES = "[[8.0, -22.0, 15.0], [4.0, -2.9, 0.5], [3.8, -2.8, 0.5]]"  # any numbers: a list is taken as given


def test_choices_are_the_librarys():
    # config.py spells Muon's names out (it runs before fsdp_optim is imported anywhere): they must stay Muon's.
    from fsdp_optim.optimizers import _muon, _orthogonalize

    assert config.ORTHOGONALIZE == _orthogonalize.ORTHOGONALIZE
    assert config.COEFFICIENTS == _orthogonalize.COEFFICIENTS
    assert set(config.GRAM_DTYPES) == set(GRAM_DTYPES) and tuple(GRAM_DTYPES.values()) == _muon._GRAM_DTYPES


def test_options_load_from_set_and_file(tmp_path):
    cfg = load_config(TINY, ["optim.orthogonalize=gram_newton_schulz", "optim.coefficients=polar_express",
                             "optim.gram_dtype=bf16", "optim.normuon_beta2=0.9", "optim.normuon_eps=1e-8"])
    o = cfg.optim
    assert (o.orthogonalize, o.coefficients, o.gram_dtype, o.normuon_beta2, o.normuon_eps) == (
        "gram_newton_schulz", "polar_express", "bf16", 0.9, 1e-8)
    assert load_config(None, [f"optim.coefficients={THREE_TRIPLES}"]).optim.coefficients == (
        (8.0, -22.0, 15.0), (4.0, -2.9, 0.5), (3.8, -2.8, 0.5))
    assert load_config(None, ["optim.coefficients=[[3, -5, 2]]"]).optim.coefficients == ((3.0, -5.0, 2.0),)
    (tmp_path / "c.toml").write_text('[optim]\nname = "normuon"\ncoefficients = [[3.4445, -4.775, 2.0315]]\n')
    assert load_config(tmp_path / "c.toml").optim.coefficients == ((3.4445, -4.775, 2.0315),)
    defaults = load_config(None).optim
    assert (defaults.orthogonalize, defaults.coefficients, defaults.gram_dtype) == ("newton_schulz", "torch", "fp16")


COEFFICIENTS_ALLOWED = r"it must be one of 'torch', 'polar_express', or a list of \[a, b, c\] per iteration, e.g. \[\["


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.orthogonalize=gram", r"optim.orthogonalize = 'gram' in --set is not allowed: it must be one of "
                                     r"'newton_schulz', 'gram_newton_schulz'$"),
        ("optim.orthogonalize=3", r"'optim.orthogonalize' in --set must be str, got 3"),
        ("optim.coefficients=polar", r"optim.coefficients = 'polar' in --set is not allowed: " + COEFFICIENTS_ALLOWED),
        ("optim.coefficients=[1, 2, 3]", r"optim.coefficients = \[1, 2, 3\] in --set is not allowed: "
                                         + COEFFICIENTS_ALLOWED),  # one triple: a list of them is needed
        ("optim.coefficients=[[1, 2]]", r"optim.coefficients = \[\[1, 2\]\] in --set is not allowed"),
        ("optim.coefficients=[[1, 2, true]]", r"optim.coefficients = \[\[1, 2, True\]\] in --set is not allowed"),
        ("optim.coefficients=[[1, 2, nan]]", r"optim.coefficients = \[\[1, 2, nan\]\] in --set is not allowed"),
        ("optim.coefficients=[]", r"optim.coefficients = \[\] in --set is not allowed"),
        ("optim.coefficients=2.0", r"optim.coefficients = 2.0 in --set is not allowed"),
        ("optim.gram_dtype=float16", r"optim.gram_dtype = 'float16' in --set is not allowed: it must be one of "
                                     r"'fp16', 'bf16', 'fp32'$"),
    ],
)
def test_bad_values_are_refused_as_the_config_is_read(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_bad_value_in_a_file_names_the_file(tmp_path):
    (tmp_path / "bad.toml").write_text('[optim]\northogonalize = "svd"\n')
    with pytest.raises(ValueError, match=r"optim.orthogonalize = 'svd' in .*bad.toml is not allowed: it must be one of"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "bad.toml").write_text('[optim]\ncoefficients = "keller"\n')
    with pytest.raises(ValueError, match=r"optim.coefficients = 'keller' in .*bad.toml is not allowed"):
        load_config(tmp_path / "bad.toml")
    # a list of 100 iterations: past Muon's own limit (1 to 99), refused here already
    (tmp_path / "bad.toml").write_text("[optim]\ncoefficients = [" + ", ".join(["[3, -4, 2]"] * 100) + "]\n")
    with pytest.raises(ValueError, match=r"optim.coefficients = \[\[3, -4, 2\], .* in .*bad.toml is not allowed"):
        load_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.normuon_beta2=1.0", r"optim.normuon_beta2 = 1.0 is out of range: it must be in \[0, 1\)"),
        ("optim.normuon_beta2=-0.1", r"optim.normuon_beta2 = -0.1 is out of range"),
        ("optim.normuon_eps=-1e-9", r"optim.normuon_eps = -1e-09 is out of range: it must be >= 0"),
    ],
)
def test_normuon_numbers_out_of_range(override, match):
    with pytest.raises(ValueError, match=match):
        check_ranges(load_config(None, [override]))


def resolve(tmp_path, *args):
    return resolve_config(parse_args(["--config", str(TINY), "--out", str(tmp_path / "run"), *args]))


@pytest.mark.parametrize(
    "args, match",
    [
        # an option of another optimizer would do nothing: refused, naming the optimizer that takes it
        (["--optimizer", "adamw", "--set", "optim.orthogonalize=gram_newton_schulz"],
         r"optim.orthogonalize = 'gram_newton_schulz' is an option of optim.name muon or normuon, but optim.name = "
         r"'adamw'; set optim.name=muon \(--optimizer muon\) or leave optim.orthogonalize out"),
        (["--optimizer", "shampoo", "--set", "optim.coefficients=polar_express"],
         r"optim.coefficients = 'polar_express' is an option of optim.name muon or normuon, but optim.name = 'shampoo'"),
        (["--optimizer", "muon", "--set", "optim.normuon_beta2=0.9"],
         r"optim.normuon_beta2 = 0.9 is an option of optim.name normuon, but optim.name = 'muon'; set "
         r"optim.name=normuon \(--optimizer normuon\)"),
        (["--optimizer", "muon", "--set", "optim.normuon_eps=0"], r"optim.normuon_eps = 0.0 is an option of optim.name normuon"),
        (["--optimizer", "normuon", "--set", "optim.gram_dtype=bf16"],
         r"optim.gram_dtype = 'bf16' applies to optim.orthogonalize = 'gram_newton_schulz' only, but "
         r"optim.orthogonalize = 'newton_schulz'"),
        # the torch backend (PyTorch FSDP2): no Muon of ours, and torch.optim.Muon has one Newton-Schulz
        (["--optimizer", "muon", "--set", "train.backend=torch", "--set", "optim.orthogonalize=gram_newton_schulz"],
         r"optim.orthogonalize = 'gram_newton_schulz' needs fsdp_optim.optimizers.Muon \(train.backend = 'fsdp_optim'\): "
         r"the torch backend runs adamw and adamw8bit, and of optim.orthogonalize only 'newton_schulz' \(what "
         r"torch.optim.Muon does\); set train.backend=fsdp_optim or leave optim.orthogonalize out"),
        (["--optimizer", "muon", "--set", "train.backend=torch", "--set", "optim.coefficients=polar_express"],
         r"optim.coefficients = 'polar_express' needs fsdp_optim.optimizers.Muon .* only 'torch' \(what torch.optim.Muon"),
        (["--optimizer", "normuon", "--set", "train.backend=torch", "--set", "optim.coefficients=[[3, -4, 2]]"],
         r"optim.coefficients = \[\[3.0, -4.0, 2.0\]\] needs fsdp_optim.optimizers.NorMuon"),
        (["--optimizer", "normuon", "--set", "train.backend=torch"],
         r"optim.name = 'normuon' needs fsdp_optim.optimizers.NorMuon \(train.backend = 'fsdp_optim'\); the torch "
         r"backend \(PyTorch FSDP2\) runs adamw and adamw8bit"),
        (["--optimizer", "muon", "--set", "train.backend=torch"], r"optim.name = 'muon' needs fsdp_optim.optimizers.Muon"),
    ],
)
def test_settings_that_would_do_nothing_or_cannot_run_are_refused(tmp_path, args, match):
    with pytest.raises(ValueError, match=match):
        resolve(tmp_path, *args)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_the_command_line_refuses_a_bad_value_before_any_rank_starts(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "d"), "--optimizer", "muon",
                        "--set", "optim.orthogonalize=gram"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("error: optim.orthogonalize = 'gram' in --set is not allowed: it must be one of "
                                "'newton_schulz', 'gram_newton_schulz'")


def test_a_resume_may_not_change_the_orthogonalization(tmp_path):
    # Muon's param groups carry orthogonalize / coefficients: a checkpoint's groups would silently put
    # the old ones back, so a resume with others is refused like any [optim] change.
    saved = load_config(TINY)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(saved)))
    check_resume_config(tmp_path, load_config(TINY))
    with pytest.raises(ValueError, match=r"holds a run with other settings: optim.orthogonalize 'newton_schulz' -> "
                                         r"'gram_newton_schulz', optim.coefficients 'torch' -> \[\[3.0, -4.0, 2.0\]\]"):
        check_resume_config(tmp_path, load_config(TINY, ["optim.orthogonalize=gram_newton_schulz",
                                                        "optim.coefficients=[[3, -4, 2]]"]))
    with pytest.raises(ValueError, match=r"optim.name 'muon' -> 'normuon', optim.normuon_beta2 0.95 -> 0.9"):
        check_resume_config(tmp_path, load_config(TINY, ["optim.name=normuon", "optim.normuon_beta2=0.9"]))


SMALL_MODEL = ["model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=32", "model.n_layers=1",
               "model.vocab_size=20"]


def _optimizer(*overrides):
    """The recipe's optimizer on the unsharded model, and its Muon (matrix) groups."""
    from model import build_model

    cfg = load_config(TINY, [*SMALL_MODEL, *overrides])
    opt = build_optimizer(build_model(cfg.model), cfg, "fsdp_optim")
    matrices = [g for g in opt.param_groups if g["use_muon"]]
    assert matrices and len(matrices) < len(opt.param_groups)  # (and the AdamW part)
    return opt, matrices


@pytest.mark.filterwarnings("ignore:Muon. .* plain .unsharded. matrix parameter")  # the model is not sharded here
@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_each_option_reaches_the_optimizer(name):
    default, groups = _optimizer(f"optim.name={name}")
    assert type(default) is {"muon": Muon, "normuon": NorMuon}[name]
    assert {(g["orthogonalize"], g["coefficients"]) for g in groups} == {("newton_schulz", "torch")}
    opt, groups = _optimizer(f"optim.name={name}", "optim.orthogonalize=gram_newton_schulz",
                             "optim.coefficients=polar_express", "optim.gram_dtype=bf16")
    assert {(g["orthogonalize"], g["coefficients"]) for g in groups} == {("gram_newton_schulz", "polar_express")}
    assert opt.gram_dtype is torch.bfloat16 and default.gram_dtype is torch.float16
    _, groups = _optimizer(f"optim.name={name}", "optim.coefficients=[[3, -4, 2], [3, -4.5, 2]]")
    assert {g["coefficients"] for g in groups} == {((3.0, -4.0, 2.0), (3.0, -4.5, 2.0))}
    if name == "normuon":  # beta2 / norm_eps configure the NorMuon (matrix) part; the defaults are the authors'
        _, groups = _optimizer("optim.name=normuon", "optim.normuon_beta2=0.8", "optim.normuon_eps=1e-6")
        assert {(g["beta2"], g["norm_eps"]) for g in groups} == {(0.8, 1e-6)}
        assert {(g["beta2"], g["norm_eps"]) for g in default.param_groups if g["use_muon"]} == {(0.95, 1e-10)}


def test_normuon_is_sharded_with_whole_matrices():
    # NorMuon refuses a matrix cut across ranks, so the recipe plans its shards with balance="whole". The
    # model is one where Muon's plan (balance="auto") does cut one: three large MLP matrices at W = 2.
    def fn():
        from model import build_model

        cut = {}
        for name in ("muon", "normuon"):
            cfg = load_config(TINY, [*SMALL_MODEL, f"optim.name={name}", "model.ffn_dim=256"])
            torch.manual_seed(0)
            model = build_model(cfg.model)
            shard_model(model, "fsdp_optim", name, torch.float32)
            opt = build_optimizer(model, cfg, "fsdp_optim")
            assert type(opt).__name__ == {"muon": "Muon", "normuon": "NorMuon"}[name]
            cut[name] = sorted(opt._plans[p].info.fqn for g in opt.param_groups if g["use_muon"] for p in g["params"]
                               if opt._plans[p].split)
        return cut

    for cut in run_distributed(fn, world_size=2, timeout=120):
        assert cut == {"muon": ["layers.0.feed_forward.w3.weight"], "normuon": []}, cut


def test_describe_optimizer():
    assert describe_optimizer(load_config(TINY)) == "muon"
    assert describe_optimizer(load_config(TINY, ["optim.name=adamw"])) == "adamw"
    assert describe_optimizer(load_config(TINY, ["optim.name=normuon", "optim.orthogonalize=gram_newton_schulz",
                                                 "optim.coefficients=polar_express"])) == (
        "normuon (gram_newton_schulz fp16, polar_express coefficients)")
    assert describe_optimizer(load_config(TINY, ["optim.coefficients=[[3, -4, 2]]"])) == (
        "muon (newton_schulz, 1 (a, b, c) coefficients)")


# ---- 2-rank runs: each option trains, and trains differently from the default Muon ----
RUNS = {
    "gram_newton_schulz": ["--set", "optim.orthogonalize=gram_newton_schulz"],
    "gram_newton_schulz bf16": ["--set", "optim.orthogonalize=gram_newton_schulz", "--set", "optim.gram_dtype=bf16"],
    "polar_express": ["--set", "optim.coefficients=polar_express"],
    "normuon": ["--optimizer", "normuon"],
    "normuon gram polar_express": ["--optimizer", "normuon", "--set", "optim.orthogonalize=gram_newton_schulz",
                                   "--set", "optim.coefficients=polar_express"],
}
STEPS = 4


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    """The runs of the default Muon and NorMuon (Newton-Schulz, torch's coefficients)."""
    out = {}
    for name in ("muon", "normuon"):
        path = tmp_path_factory.mktemp(name)
        train(path, "--optimizer", name, steps=STEPS)
        out[name] = check_outputs(path, STEPS)
    return out


@pytest.mark.parametrize("run", list(RUNS))
def test_each_option_trains_and_changes_the_run(tmp_path, run, defaults):
    res = train(tmp_path, *RUNS[run], steps=STEPS)
    records = check_outputs(tmp_path, STEPS)  # finite losses, eval loss, plot, checkpoint
    assert res["backend"] == "fsdp_optim" and records == res["records"]
    assert records[-1]["loss"] < records[0]["loss"]
    # Compared with the run it changes (normuon with options: the default NorMuon; the rest: the default
    # Muon): step 1's loss is one forward of the same initial model on the same batch; from step 2 on,
    # the loss follows the updates, which the option changes.
    name = json.loads((tmp_path / "config.json").read_text())["optim"]["name"]
    assert name == ("normuon" if "normuon" in run else "muon")
    base = defaults["muon" if run == "normuon" else name]
    assert records[0]["loss"] == base[0]["loss"]
    assert all(a["loss"] != b["loss"] for a, b in zip(records[1:], base[1:])), (records, base)


def test_normuon_resumes_as_if_uninterrupted(tmp_path):
    # The checkpoint carries NorMuon's second moments and the groups' orthogonalize / coefficients: a run
    # stopped at step 2 and resumed gives the uninterrupted run's numbers, bitwise.
    args = [*RUNS["normuon gram polar_express"], "--set", "log.ckpt_every=1"]
    whole = train(tmp_path / "whole", *args, steps=STEPS)["records"]
    train(tmp_path / "run", *args, steps=2)
    res = train(tmp_path / "run", *args, "--resume", steps=STEPS)
    assert res["resumed_from"].endswith("step_000002")
    keys = ("step", "loss", "lr", "grad_norm")  # (eval_loss: at each run's last step, so also at step 2 here)
    assert [[r[k] for k in keys] for r in res["records"]] == [[r[k] for k in keys] for r in whole]
    assert res["records"][-1]["eval_loss"] == whole[-1]["eval_loss"]
