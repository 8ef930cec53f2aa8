"""Training-time interventions: each arm's forward, determinism, exact resume, saving, the paired analysis."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers
from scipy import stats as sps

from lens_parallel import LensParallelError, load_model
from lens_parallel.edits import GatedRemoval, LearnedGate, compile_hooks
from lens_parallel.hooks import expand_kv, hook_name
from lens_parallel.models import model_info
from lens_parallel.protocols import designs
from lens_parallel.tokenizers import load_bundled_tokenizer
from lens_parallel.training import (
    ARMS,
    PRESETS,
    ArmParameters,
    TrainConfig,
    factorial,
    load_trained,
    paired_table,
    train,
)
from lens_parallel.training.factorial import run_factorial
from lens_parallel.training.loop import ARM_FILE, batch_indices, build_model, learning_rate, training_data

TINY = PRESETS["tiny"]
TINY_GQA = dataclasses.replace(TINY, architecture="qwen3", n_heads=4, n_kv_heads=2)


def _par(m: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The component of m along r, written independently of geometry.py."""
    return ((m * r).sum(-1, keepdim=True) / (r * r).sum(-1, keepdim=True)) * r


def _randomise(params: ArmParameters) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in params.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def _capture_around(model, edits, tokens, role: str, extra: tuple[str, ...]):
    """Every layer's ``role`` activation before and after the edit hooks, and the ``extra`` roles they read."""
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(t, hook, *, key):
        seen[key] = t.detach().clone()

    n = model.cfg.n_layers
    before = [
        (hook_name(layer, role), lambda t, hook, layer=layer: keep(t, hook, key=("before", layer)))
        for layer in range(n)
    ]
    after = [
        (hook_name(layer, role), lambda t, hook, layer=layer: keep(t, hook, key=("after", layer))) for layer in range(n)
    ]
    reads = [
        (hook_name(layer, r), lambda t, hook, layer=layer, r=r: keep(t, hook, key=(r, layer)))
        for layer in range(n)
        for r in extra
    ]
    with torch.no_grad(), model.hooks(fwd_hooks=reads + before + compile_hooks(model, edits) + after):
        model(tokens)
    return seen


@pytest.mark.parametrize("config", [TINY, TINY_GQA], ids=["gpt2", "qwen3-gqa"])
@pytest.mark.parametrize("arm", [a for a in ARMS if a != "baseline"])
def test_each_arm_changes_the_forward_as_specified(config, arm):
    model = build_model(config, seed=0)
    info = model_info(model)
    params = ArmParameters(arm, info)
    _randomise(params)
    _, _, val = training_data(config)
    tokens = val[:2]
    if arm == "residual-parallel-removal":
        seen = _capture_around(model, params.edits(), tokens, "attn_out", ("resid_pre",))
        for layer in range(info.n_layers):
            m, x = seen[("before", layer)], seen[("resid_pre", layer)]
            torch.testing.assert_close(seen[("after", layer)], m - _par(m, x), rtol=1e-5, atol=1e-6)
        return
    seen = _capture_around(model, params.edits(), tokens, "z", ("v", "resid_pre"))
    for layer in range(info.n_layers):
        y = seen[("before", layer)]
        v = expand_kv(seen[("v", layer)], info.n_heads)
        if arm == "value-parallel-removal":
            expected = y - _par(y, v)
        elif arm == "xsa-gated":
            expected = y - torch.tanh(params.alpha[layer])[:, None] * _par(y, v)
        elif arm == "random-direction":
            expected = y - _par(y, params.directions[layer].expand_as(y))
        elif arm == "random-direction-gated":
            expected = y - torch.tanh(params.alpha[layer])[:, None] * _par(y, params.directions[layer].expand_as(y))
        elif arm == "learned-gate":
            x = seen[("resid_pre", layer)]
            s = torch.sigmoid(x @ params.weight[layer].T + params.bias[layer])
            expected = y + (s[..., None] - 1) * _par(y, v)
        elif arm == "learned-gate-layer":  # the removed part scaled by one gate per layer: s_par = 1 - gate
            x = seen[("resid_pre", layer)]
            w, b = -params.weight[layer], -params.bias[layer]  # the authors' (w, b), stored negated
            gate = torch.sigmoid(x @ w + b)  # [batch, pos], every head
            expected = y - gate[..., None, None] * _par(y, v)
        else:  # xsa-alpha-layer: alpha = sigmoid(a) per layer, every head
            expected = y - torch.sigmoid(params.alpha[layer]) * _par(y, v)
        torch.testing.assert_close(seen[("after", layer)], expected.detach(), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(seen[("after", layer)], y, atol=1e-4)  # the edit did something


@pytest.mark.parametrize("config", [TINY, TINY_GQA], ids=["gpt2", "qwen3-gqa"])
def test_the_papers_layer_arms_count_their_parameters_and_start_as_stated(config):
    """learned-gate-layer: d_model + 1 parameters per layer, s_par = 1 - gate_init at every token at init;
    xsa-alpha-layer: one per layer, a = logit(1 - 1e-6) = 13.8155, s_par = 1e-6 (full removal) at init."""
    model = build_model(config, seed=0)
    info = model_info(model)
    _, _, val = training_data(config)
    tokens = val[:2]
    gate = ArmParameters("learned-gate-layer", info, gate_init=0.3)
    assert sum(p.numel() for p in gate.parameters()) == info.n_layers * (info.d_model + 1)
    torch.testing.assert_close(torch.sigmoid(-gate.bias), torch.full((info.n_layers,), 0.3))  # stored as -b
    alpha = ArmParameters("xsa-alpha-layer", info)
    assert sum(p.numel() for p in alpha.parameters()) == info.n_layers
    assert alpha.alpha.tolist() == pytest.approx([13.815509557963773] * info.n_layers, abs=1e-5)
    torch.testing.assert_close(alpha.gates(), torch.full((info.n_layers, info.n_heads), 1 - 1e-6))
    for params, s_par in ((gate, 0.7), (alpha, 1e-6)):
        seen = _capture_around(model, params.edits(), tokens, "z", ("v",))
        for layer in range(info.n_layers):
            y, v = seen[("before", layer)], expand_kv(seen[("v", layer)], info.n_heads)
            expected = y + (s_par - 1) * _par(y, v)
            torch.testing.assert_close(seen[("after", layer)], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"gate_init=1\.0 \(a finite number strictly between 0 and 1\)"):
        dataclasses.replace(TINY, gate_init=1.0)


def test_gate_init_is_in_the_digest_and_the_plan_only_where_it_is_set(tmp_path):
    """Configs of earlier versions keep their digests (gate_init at its default is not written); another gate_init
    is another config, and a factorial with learned-gate-layer writes it into its plan."""
    assert PRESETS["tiny"].digest() == "21e271ef04cd" and PRESETS["cpu-small"].digest() == "f3da03045731"
    assert "gate_init" not in PRESETS["tiny"].to_dict()
    other = dataclasses.replace(TINY, gate_init=0.9)
    assert other.digest() != TINY.digest() and TrainConfig.from_dict(other.to_dict()) == other
    assert TrainConfig.from_dict(TINY.to_dict()).gate_init == 0.5
    cfg = dataclasses.replace(TINY, steps=4, eval_every=2, gate_init=0.9)
    plan = tmp_path / "plan.json"
    run_factorial(cfg, ["baseline", "learned-gate-layer"], [0, 1], out=tmp_path / "runs", plan=plan, progress=False)
    frozen = json.loads(plan.read_text())
    assert frozen["gate_init"] == 0.9 and frozen["config"]["gate_init"] == 0.9


def test_random_directions_are_unit_seeded_by_layer_and_shared_across_seeds():
    a = ArmParameters("random-direction", model_info(build_model(TINY, seed=0)))
    b = ArmParameters("random-direction", model_info(build_model(TINY, seed=1)))
    assert torch.equal(a.directions, b.directions)
    torch.testing.assert_close(a.directions.norm(dim=-1), torch.ones(TINY.n_layers, TINY.n_heads))
    assert not torch.allclose(a.directions[0], a.directions[1])


@pytest.mark.parametrize("arm", ["xsa-gated", "random-direction-gated"])
def test_gated_arms_equal_baseline_bit_for_bit_at_init(arm):
    model = build_model(TINY_GQA, seed=3)
    params = ArmParameters(arm, model_info(model))
    _, _, val = training_data(TINY_GQA)
    with torch.no_grad():
        plain = model(val[:4])
        with model.hooks(fwd_hooks=compile_hooks(model, params.edits())):
            gated = model(val[:4])
    assert torch.equal(plain, gated)


def test_data_order_is_a_function_of_seed_and_step():
    n = 50

    def order(seed: int, steps: range) -> torch.Tensor:
        return torch.cat([batch_indices(s, batch_size=5, n_train=n, seed=seed) for s in steps])

    first_epoch = order(7, range(10))
    assert sorted(first_epoch.tolist()) == list(range(n))  # one epoch visits every block once
    assert torch.equal(first_epoch, order(7, range(10)))
    assert not torch.equal(first_epoch, order(8, range(10)))
    second_epoch = order(7, range(10, 20))
    assert sorted(second_epoch.tolist()) == list(range(n)) and not torch.equal(first_epoch, second_epoch)


def test_learning_rate_schedule():
    cfg = dataclasses.replace(TINY, lr=1e-2, warmup_steps=4, steps=20, min_lr_ratio=0.1)
    assert learning_rate(0, cfg) == pytest.approx(2.5e-3)
    assert learning_rate(3, cfg) == pytest.approx(1e-2)
    assert learning_rate(4, cfg) == pytest.approx(1e-2)
    assert learning_rate(12, cfg) == pytest.approx(1e-3 + 0.9e-2 * 0.5)  # halfway through the cosine
    assert learning_rate(20, cfg) == pytest.approx(1e-3)


def test_same_seed_same_curve_and_arms_share_the_start(tmp_path):
    a = train(TINY, "baseline", 0, out=tmp_path / "a", progress=False)
    b = train(TINY, "baseline", 0, out=tmp_path / "b", progress=False)
    c = train(TINY, "baseline", 1, out=tmp_path / "c", progress=False)
    x = train(TINY, "xsa-gated", 0, out=tmp_path / "x", progress=False)
    assert np.array_equal(a.train_loss, b.train_loss) and np.array_equal(a.val_loss, b.val_loss)
    assert len(a.train_loss) == TINY.steps and list(a.eval_steps) == [0, 4, 8, 12]
    assert not np.array_equal(a.train_loss, c.train_loss)
    assert x.val_loss[0] == a.val_loss[0] and x.train_loss[0] == a.train_loss[0]  # alpha = 0: baseline at init
    assert a.val_loss[-1] < a.val_loss[0]  # it learns
    assert x.gates.shape == (TINY.n_layers, TINY.n_heads) and np.all(np.abs(x.gates) < 1)


class _Killed(Exception):
    pass


@pytest.mark.parametrize("arm", ["baseline", "xsa-gated", "learned-gate", "learned-gate-layer", "xsa-alpha-layer"])
def test_killed_and_resumed_run_is_bit_identical(tmp_path, arm):
    full = train(TINY, arm, 0, out=tmp_path / "full", progress=False)

    def kill_at_7(step, loss):
        if step == 7:
            raise _Killed

    with pytest.raises(_Killed):
        train(TINY, arm, 0, out=tmp_path / "killed", progress=False, callback=kill_at_7)
    assert (tmp_path / "killed" / "checkpoint.pt").is_file() and not (tmp_path / "killed" / "run.json").exists()
    resumed = train(TINY, arm, 0, out=tmp_path / "killed", progress=False)
    assert np.array_equal(full.train_loss, resumed.train_loss) and np.array_equal(full.val_loss, resumed.val_loss)
    if full.gates is not None:
        assert np.array_equal(full.gates, resumed.gates)
    trained = torch.load(f"{full.model_dir}/{ARM_FILE}", weights_only=True)["state"]
    init = ArmParameters(arm, model_info(build_model(TINY, seed=0))).state_dict()
    for name, start in init.items():  # every learnable tensor moved: the compiled hooks saw each update
        assert name == "directions" or not torch.equal(trained[name], start), name
    m_full, m_res = load_model(full.model_dir), load_model(resumed.model_dir)
    for (k, p), (_, q) in zip(
        m_full.original_model.state_dict().items(), m_res.original_model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), k
    assert not (tmp_path / "killed" / "checkpoint.pt").exists()
    (tmp_path / "other").mkdir()
    other = {"config": "another config", "arm": arm, "seed": 0, "device_type": "cpu", "precision": "float32"}
    torch.save({"identity": other}, tmp_path / "other" / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"belongs to another run \(config 'another config'"):
        train(TINY, arm, 0, out=tmp_path / "other", progress=False)


def test_saved_model_loads_back_as_an_ordinary_model(tmp_path):
    run = train(TINY_GQA, "learned-gate", 0, out=tmp_path / "run", progress=False)
    model, edits = load_trained(run.model_dir)
    info = model_info(model)
    assert (info.family, info.n_heads, info.n_kv_heads, info.n_layers) == ("qwen3", 4, 2, 2)
    _, _, val = training_data(TINY_GQA)
    from lens_parallel.analyses.evaluate import document_losses

    assert document_losses(model, val, edits, batch_size=4).loss == pytest.approx(run.final_val_loss, rel=1e-5)
    plain = load_model(run.model_dir)
    assert document_losses(plain, val, batch_size=4).loss != pytest.approx(run.final_val_loss, rel=1e-5)
    from lens_parallel import decompose

    assert decompose(plain, val[:2], space="value").to_dataframe()["self_cos"].notna().all()


def test_paired_table_endpoints_match_scipy_and_holm_by_hand():
    """8 seeds, known differences: primary / secondary / contrast / exploratory rows, p from scipy's paired t,
    Holm by hand within each family."""
    rng = np.random.default_rng(0)
    base = 4.0 + rng.normal(0, 0.1, 8)
    arms = {
        "baseline": base,
        "random-direction-gated": base + 0.001 + rng.normal(0, 0.002, 8),
        "xsa-gated": base - 0.003 + rng.normal(0, 0.002, 8),
        "value-parallel-removal": base - 0.002 + rng.normal(0, 0.002, 8),
        "learned-gate": base + rng.normal(0, 0.002, 8),
    }
    finals = pd.DataFrame([{"arm": a, "seed": s, "final_val_loss": v[s]} for a, v in arms.items() for s in range(8)])
    table = paired_table(
        finals,
        primary="random-direction-gated",
        secondary=["xsa-gated", "value-parallel-removal"],
        contrasts=[("xsa-gated", "random-direction-gated"), ("value-parallel-removal", "xsa-gated")],
    ).set_index("contrast")
    roles = table["role"].to_dict()
    assert roles == {
        "random-direction-gated - baseline": "primary",
        "xsa-gated - baseline": "secondary",
        "value-parallel-removal - baseline": "secondary",
        "learned-gate - baseline": "exploratory",
        "xsa-gated - random-direction-gated": "contrast",
        "value-parallel-removal - xsa-gated": "contrast",
    }
    for contrast, row in table.iterrows():
        a, b = contrast.split(" - ")
        ref = sps.ttest_rel(arms[a], arms[b])
        d = arms[a] - arms[b]
        assert row["t"] == pytest.approx(ref.statistic) and row["p"] == pytest.approx(ref.pvalue)
        assert row["mean_delta"] == pytest.approx(d.mean()) and row["ci_lo"] <= d.mean() <= row["ci_hi"]
        assert row["cohens_dz"] == pytest.approx(d.mean() / d.std(ddof=1))
        assert row["mde_paper"] == pytest.approx(2.9 * d.std(ddof=1) / np.sqrt(8))
        assert row["mde_paper"] < row["mde_80"] < row["mde_90"]
    for family in ("secondary", "contrast"):
        rows = table[table.family == family]
        p = rows["p"].to_numpy()
        order = np.argsort(p)
        by_hand = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p[order]))
        np.testing.assert_allclose(rows["p_holm"].to_numpy()[order], by_hand)
    for single in ("random-direction-gated - baseline", "learned-gate - baseline"):  # families of one
        assert table.loc[single, "p_holm"] == table.loc[single, "p"]
    with pytest.raises(ValueError, match=r"contrasts \[\('xsa-gated', 'xsa-gated'\)\] must be pairs"):
        paired_table(finals, primary="xsa-gated", contrasts=[("xsa-gated", "xsa-gated")])


def test_paper_presets_parameter_counts():
    """The sanity-checks paper's factorial model is 50.9M parameters (8 layers, 8 heads, width 512); the Qwen3-style
    GPU preset is 59.3M (SwiGLU has three MLP matrices)."""
    vocab = len(load_bundled_tokenizer("gpt2"))
    counts = {}
    for name in ("xsa-controls-51m", "qwen3-59m"):
        config = PRESETS[name]
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config.hf_config(vocab, 50256))
        counts[name] = sum(p.numel() for p in model.parameters())
    assert abs(counts["xsa-controls-51m"] - 50.9e6) < 0.1e6 and abs(counts["qwen3-59m"] - 59.3e6) < 0.1e6
    assert PRESETS["xsa-controls-51m"].tokens_per_run == 399_900_672
    assert PRESETS["xsa-controls-51m"].with_tokens(400_000_000).steps == 3051
    design = designs()["xsa-controls"]
    assert design.primary == "random-direction-gated" and design.secondary == ("xsa-gated",)
    assert design.contrasts == (("xsa-gated", "random-direction-gated"),) and len(design.seeds) == 8


def test_gpt_neox_architecture_trains_with_gated_arms(tmp_path):
    config = dataclasses.replace(TINY, architecture="gpt-neox", steps=4, eval_every=2)
    run = train(config, "random-direction-gated", 0, out=tmp_path, progress=False)
    assert np.isfinite(run.final_val_loss) and run.gates.shape == (config.n_layers, config.n_heads)


def test_a_frozen_plan_resumes_unchanged_and_refuses_changes(tmp_path):
    cfg = dataclasses.replace(TINY, steps=4, eval_every=2)
    arms, plan = ["baseline", "xsa-gated"], tmp_path / "plan.json"
    first = run_factorial(cfg, arms, [0, 1], out=tmp_path / "runs", plan=plan, progress=False)
    frozen = json.loads(plan.read_text())
    assert frozen["endpoints"]["primary"]["contrast"] == "xsa-gated - baseline"
    assert frozen["tokens_per_run"] == 4 * cfg.batch_size * cfg.seq_len and frozen["config_hash"] == cfg.digest()
    again = run_factorial(cfg, arms, [0, 1], out=tmp_path / "runs", plan=plan, progress=False)
    assert again.plan_hash == first.plan_hash is not None
    with pytest.raises(ValueError, match=r"the analysis plan changed after training started \(alpha differ"):
        run_factorial(cfg, arms, [0, 1], out=tmp_path / "runs", plan=plan, alpha=0.01, progress=False)
    with pytest.raises(ValueError, match=r"plan changed after training started \(config, config_hash, tokens_per_run"):
        run_factorial(dataclasses.replace(cfg, steps=6), arms, [0, 1], out=tmp_path / "runs", plan=plan)
    plan.write_text(plan.read_text().replace('"alpha": 0.05', '"alpha": 0.1'))
    with pytest.raises(ValueError, match="was edited after training started"):
        run_factorial(cfg, arms, [0, 1], out=tmp_path / "runs", plan=plan, progress=False)
    with pytest.raises(ValueError, match="no plan was frozen before them"):
        run_factorial(cfg, arms, [0, 1], out=tmp_path / "runs", plan=tmp_path / "late.json", progress=False)


def test_factorial_runs_pairs_saves_and_plots(tmp_path):
    cfg = dataclasses.replace(TINY, steps=6, eval_every=3)
    result = run_factorial(
        cfg, ["baseline", "value-parallel-removal", "xsa-gated"], [0, 1], out=tmp_path, progress=False
    )
    table = result.paired_table()
    assert list(table["arm"]) == ["value-parallel-removal", "xsa-gated"] and (table["n_seeds"] == 2).all()
    assert list(table["role"]) == ["primary", "secondary"] and result.plan_hash is None
    tidy = result.to_dataframe()  # one row per (arm, seed)
    assert len(tidy) == 3 * 2 and (tidy[tidy.arm == "baseline"].delta == 0).all()
    finals = result.finals().pivot(index="seed", columns="arm", values="final_val_loss")
    assert table.iloc[0]["mean_delta"] == pytest.approx((finals["value-parallel-removal"] - finals["baseline"]).mean())
    again = run_factorial(
        cfg, ["baseline", "value-parallel-removal", "xsa-gated"], [0, 1], out=tmp_path, progress=False
    )  # finished runs are read back
    pd.testing.assert_frame_equal(again.paired_table(), table)
    loaded = type(result).load(tmp_path / "factorial")
    pd.testing.assert_frame_equal(loaded.paired_table(), table)
    fig = result.figure()
    assert {t.name for t in fig.data} >= {"baseline", "value-parallel-removal", "xsa-gated"}
    assert fig.layout.yaxis.title.text == "validation loss (nats/token)"
    # the training loss (Fig. 8 of the directional-decomposition paper): the mean over seeds of a running mean
    train_fig = result.figure(loss="training", smooth=2)
    mean = next(t for t in train_fig.data if t.name == "baseline")
    runs = [r.train_loss for r in result.runs if r.arm == "baseline"]
    running = [np.convolve(loss, [0.5, 0.5])[: len(loss)] for loss in runs]
    for r, loss in zip(running, runs, strict=True):
        r[0] = loss[0]  # the first point is its own mean
    np.testing.assert_allclose(mean.y, np.mean(running, axis=0), rtol=1e-12)
    assert list(mean.x) == list(range(1, cfg.steps + 1))
    assert (
        train_fig.layout.yaxis.title.text == "training loss (nats/token, batch loss per step, running mean of 2 steps)"
    )
    assert set(result.figures()) == {"train", "train_loss", "gates"}
    gates = result.gates()
    assert set(gates["arm"]) == {"xsa-gated"} and len(gates) == 2 * TINY.n_layers * TINY.n_heads
    assert len(result.gates_figure().data) == 2


def test_gate_parameters_of_the_wrong_shape_are_refused():
    model = build_model(TINY, seed=0)  # 2 layers x 2 heads, d_model 32
    info = model_info(model)
    with pytest.raises(ValueError, match=r"GatedRemoval.alpha must have shape \(2, 2\), got \(2, 1\)"):
        compile_hooks(model, [GatedRemoval(alpha=torch.zeros(info.n_layers, 1))])
    gate = LearnedGate(
        weight=torch.zeros(info.n_layers, info.n_heads, 16), bias=torch.zeros(info.n_layers, info.n_heads)
    )
    with pytest.raises(ValueError, match=r"LearnedGate needs weight \(2, 2, 32\) and bias \(2, 2\), got \(2, 2, 16\)"):
        compile_hooks(model, [gate])


def test_a_finished_run_of_other_settings_is_refused(tmp_path):
    cfg = dataclasses.replace(TINY, steps=3, eval_every=1)
    run = train(cfg, "baseline", 0, out=tmp_path, progress=False)
    assert train(cfg, "baseline", 0, out=tmp_path, progress=False).final_val_loss == run.final_val_loss  # read back
    for other_cfg, arm, seed in (
        (cfg, "baseline", 1),
        (cfg, "xsa-gated", 0),
        (dataclasses.replace(cfg, lr=1e-3), "baseline", 0),
    ):
        with pytest.raises(ValueError, match=r"run\.json belongs to another run"):
            train(other_cfg, arm, seed, out=tmp_path, progress=False)


def test_bad_inputs_raise_before_training(tmp_path):
    with pytest.raises(ValueError, match="architecture"):
        TrainConfig(architecture="mamba")
    with pytest.raises(ValueError, match="n_kv_heads"):
        TrainConfig(n_kv_heads=2)  # GQA on a GPT-2 config
    with pytest.raises(ValueError, match="tokenizer"):
        TrainConfig(tokenizer="bpe-10")
    for field, value in (
        ("lr", float("nan")),
        ("lr", 0.0),
        ("weight_decay", float("inf")),
        ("grad_clip", -1.0),
        ("min_lr_ratio", float("nan")),
        ("min_lr_ratio", 2.0),
    ):
        with pytest.raises(ValueError, match=f"{field}="):
            TrainConfig(**{field: value})
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(warmup_steps=400)
    with pytest.raises(ValueError, match="unknown arm"):
        train(TINY, "xsa", 0, out=tmp_path)
    with pytest.raises(ValueError, match="baseline"):
        run_factorial(TINY, ["xsa-gated", "value-parallel-removal"], [0, 1], out=tmp_path)
    with pytest.raises(ValueError, match="2 distinct seeds"):
        run_factorial(TINY, ["baseline", "xsa-gated"], [0, 0], out=tmp_path)
    assert not any(tmp_path.iterdir())


def _killed_run(out, config=TINY, step: int = 5):
    def kill(done, loss):
        if done == step:
            raise _Killed

    with pytest.raises(_Killed):
        train(config, "baseline", 0, out=out, progress=False, callback=kill)
    return out / "checkpoint.pt"


def test_precision_and_device_are_part_of_a_runs_identity(tmp_path):
    """A bf16 (GPU) checkpoint never resumes as a float32 CPU run, nor is a finished bf16 run reused in a float32
    factorial; checkpoints that do not record their precision are refused, not guessed."""
    ckpt = _killed_run(tmp_path / "ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["identity"] == {
        "config": TINY.digest(),
        "arm": "baseline",
        "seed": 0,
        "device_type": "cpu",
        "precision": "float32",
    }
    torch.save(saved | {"identity": saved["identity"] | {"precision": "bfloat16", "device_type": "cuda"}}, ckpt)
    with pytest.raises(LensParallelError, match=r"another run .*precision 'bfloat16' \(this run: 'float32'\)"):
        train(TINY, "baseline", 0, out=tmp_path / "ckpt", progress=False)
    torch.save({k: v for k, v in saved.items() if k != "identity"} | {"digest": TINY.digest()}, ckpt)
    with pytest.raises(LensParallelError, match="older lens_parallel that did not record the device and precision"):
        train(TINY, "baseline", 0, out=tmp_path / "ckpt", progress=False)
    cfg = dataclasses.replace(TINY, steps=3, eval_every=1)
    train(cfg, "baseline", 0, out=tmp_path / "f" / "baseline" / "seed0", progress=False)
    run_json = tmp_path / "f" / "baseline" / "seed0" / "run.json"
    run_json.write_text(run_json.read_text().replace('"precision": "float32"', '"precision": "bfloat16"'))
    with pytest.raises(LensParallelError, match=r"run\.json belongs to another run \(precision 'bfloat16'"):
        run_factorial(cfg, ["baseline", "xsa-gated"], [0, 1], out=tmp_path / "f", progress=False)


def test_a_factorial_refuses_runs_of_mixed_precision(tmp_path, monkeypatch):
    """Under Ray each worker resolves device and precision itself: runs that came back different are not paired."""
    cfg = dataclasses.replace(TINY, steps=3, eval_every=1)
    real = factorial.train

    def on_two_machines(config, arm, seed, out, progress=True):
        run = real(config, arm, seed, out=out, progress=False)
        return dataclasses.replace(run, precision="bfloat16", device_type="cuda") if seed == 1 else run

    monkeypatch.setattr(factorial, "train", on_two_machines)
    with pytest.raises(LensParallelError, match=r"trained on different devices or precisions .*seed 1: cuda bfloat16"):
        run_factorial(cfg, ["baseline", "xsa-gated"], [0, 1], out=tmp_path, progress=False)


def test_the_plan_file_is_protected(tmp_path):
    """A plan is written only to a new path or over a plan this package wrote for the same folder of runs; it records
    that folder and refuses another; a malformed, foreign, older or unwritable plan is one line."""
    cfg = dataclasses.replace(TINY, steps=3, eval_every=1)
    arms, seeds = ["baseline", "xsa-gated"], [0, 1]
    table = tmp_path / "results.csv"
    table.write_text("arm,loss\nbaseline,1.0\n")
    with pytest.raises(LensParallelError, match=r"results\.csv exists and is not a plan this package wrote \(not JSON"):
        run_factorial(cfg, arms, seeds, out=tmp_path / "a", plan=table, progress=False)
    assert table.read_text() == "arm,loss\nbaseline,1.0\n" and not (tmp_path / "a" / "baseline").exists()
    plan = tmp_path / "plan.json"
    first = run_factorial(cfg, arms, seeds, out=tmp_path / "a", plan=plan, progress=False)
    assert json.loads(plan.read_text())["out"] == str((tmp_path / "a").resolve())
    with pytest.raises(LensParallelError, match=r"plan\.json governs the runs in .*/a, not .*/b"):
        run_factorial(cfg, arms, seeds, out=tmp_path / "b", plan=plan, progress=False)
    assert not (tmp_path / "b" / "baseline").exists()
    again = run_factorial(cfg, arms, seeds, out=tmp_path / "a", plan=plan, progress=False)  # still its own plan
    assert again.plan_hash == first.plan_hash
    draft = tmp_path / "draft.json"  # before any run, the package's own plan for the same folder may change
    run_factorial(cfg, arms, seeds, out=tmp_path / "c", plan=draft, alpha=0.1, progress=False)
    for text, message in (
        (plan.read_text()[:40], "not JSON"),
        (json.dumps({"arms": arms}), "format None"),
        (json.dumps({"format": "lens_parallel.plan/1", "arms": arms}), r"older lens_parallel \(format lens_parallel"),
    ):
        foreign = tmp_path / "foreign.json"
        foreign.write_text(text)
        with pytest.raises(LensParallelError, match=message):
            run_factorial(cfg, arms, seeds, out=tmp_path / "d", plan=foreign, progress=False)
    with pytest.raises(LensParallelError, match="cannot write the plan"):
        run_factorial(cfg, arms, seeds, out=tmp_path / "e", plan=table / "plan.json", progress=False)


def test_negative_seeds_and_damaged_files_are_refused_before_training(tmp_path):
    with pytest.raises(LensParallelError, match="a training seed must be an integer >= 0, got -1"):
        run_factorial(TINY, ["baseline", "xsa-gated"], [-1, 0], out=tmp_path / "f")
    assert not (tmp_path / "f").exists()
    with pytest.raises(LensParallelError, match="got -1"):
        train(TINY, "baseline", -1, out=tmp_path / "t")
    ckpt = _killed_run(tmp_path / "k")
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(LensParallelError, match=r"checkpoint\.pt is damaged .*delete .* to restart this run"):
        train(TINY, "baseline", 0, out=tmp_path / "k", progress=False)
    cfg = dataclasses.replace(TINY, steps=3, eval_every=1)
    train(cfg, "baseline", 0, out=tmp_path / "r", progress=False)
    run_json = tmp_path / "r" / "run.json"
    run_json.write_text(run_json.read_text()[:200])
    with pytest.raises(LensParallelError, match=r"the finished run in .*/r cannot be read .*run\.json is damaged"):
        train(cfg, "baseline", 0, out=tmp_path / "r", progress=False)
