"""trainsan.integrations.hf.TrainSanCallback with transformers.Trainer: a tiny GPT-2 on random
tokens, trained for a few steps on the CPU. Clean runs (gradient accumulation, evaluation passes,
steps a GradScaler skips) must be silent at error level; planted bugs (a detached block, NaN
embeddings, 1-based labels, an optimizer that skips a param group) must be found.

Needs transformers and accelerate (scripts/install_deps.sh installs the tested versions,
best effort); without them these tests skip."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

import trainsan

STEPS = 6  # optimizer steps per run
ACCUM = 2  # gradient_accumulation_steps
VOCAB = 128
SEQ = 16
SKIP_REASON = (
    "transformers (with accelerate) is not installed or does not import: the test-only "
    "dependency of scripts/install_deps.sh (pip install transformers==5.24.0 accelerate==1.15.0)"
)


@pytest.fixture(scope="module")
def hf():
    # exc_type=ImportError: a broken install (a missing dependency of theirs) skips as well.
    tf = pytest.importorskip("transformers", reason=SKIP_REASON, exc_type=ImportError)
    pytest.importorskip("accelerate", reason=SKIP_REASON, exc_type=ImportError)
    try:  # transformers imports lazily: what these tests use, now
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa
    except ImportError as e:
        pytest.skip(f"{SKIP_REASON}; importing it failed: {e}")
    tf.logging.set_verbosity_error()
    from trainsan.integrations.hf import TrainSanCallback

    return types.SimpleNamespace(tf=tf, Callback=TrainSanCallback)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, n, seed, label_shift=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if label_shift:
            self.ids[:, -1] = VOCAB - 1  # a label shifted out of range in every sequence
        self.label_shift = label_shift

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i] + self.label_shift}


def _model(hf):
    torch.manual_seed(0)
    cfg = hf.tf.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )
    return hf.tf.GPT2LMHeadModel(cfg)


def _trainer(hf, tmp_path, model, callback, *, evaluate=False, label_shift=0, optimizer=None,
             **args):
    kw = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if evaluate:
        kw.update(eval_strategy="steps", eval_steps=2)
    kw.update(args)
    return hf.tf.Trainer(
        model=model,
        args=hf.tf.TrainingArguments(**kw),
        train_dataset=Tokens(4 * ACCUM * STEPS, seed=1, label_shift=label_shift),
        eval_dataset=Tokens(8, seed=2) if evaluate else None,
        callbacks=[callback],
        optimizers=(optimizer, None) if optimizer is not None else (None, None),
    )


def _errors(findings):
    return sorted({f.kind for f in findings if f.severity == "error"})


def _kinds(findings):
    return sorted({f.kind for f in findings})


# -- without the framework --------------------------------------------------------------------


def test_importable_without_transformers_and_says_what_to_install():
    code = r"""
import sys
sys.modules["transformers"] = None  # import transformers -> ImportError
import trainsan.integrations, trainsan.integrations.hf
from trainsan.integrations.hf import TrainSanCallback
from trainsan.integrations import TrainSanCallback as again
try:
    TrainSanCallback(policy="raise")
except ImportError as e:
    print("IMPORTERROR", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout and "pip install transformers" in out.stdout, out.stdout


def test_import_does_not_import_transformers():
    code = "import sys, trainsan.integrations.hf; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- clean runs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"activation_checkpointing": True, "bf16": True}],
    ids=["fp32", "checkpointing+bf16"],
)
def test_clean_run_with_accumulation_and_evaluation_is_silent(hf, tmp_path, extra):
    texts = []
    cb = hf.Callback(policy="raise", summary=texts.append, trace=str(tmp_path / "run.{rank}.jsonl"))
    trainer = _trainer(hf, tmp_path, _model(hf), cb, evaluate=True, **extra)
    trainer.train()
    san = cb.sanitizer
    assert san.closed
    assert _errors(cb.findings) == [], [f.message for f in cb.findings]
    cov = san.coverage()
    assert cov["steps_checked"] == STEPS
    assert cov["losses_checked"] == STEPS * ACCUM  # every micro-batch's loss
    assert cov["training_forwards"] == STEPS * ACCUM
    assert cov["other_forwards"] > 0  # the evaluation passes ran while attached
    assert cov["unchecked"] == {}
    assert sum("eval_loss" in r for r in trainer.state.log_history) >= 2
    assert len(texts) == 1 and texts[0].startswith(f"trainsan: {STEPS} steps")
    summary = json.loads((tmp_path / "run.0.jsonl").read_text().splitlines()[-1])  # {rank}: 0
    assert summary["type"] == "summary" and summary["steps"] == STEPS


@pytest.mark.parametrize(
    "optim",
    [
        "adamw_torch",
        "adamw_torch_fused",
    ],
)
def test_gradscaler_skips_are_silent(hf, tmp_path, optim):
    """A GradScaler whose first scales overflow fp32: the first steps are skipped (accelerate
    asks torch.amp.GradScaler.step), which is legitimate: AMP skips, no skipped_step. (fp16 on a
    CPU has no scaler in accelerate; the scaler is handed to it as on a GPU.)"""
    cb = hf.Callback(policy="raise", trace=str(tmp_path / "run.jsonl"), summary=False)
    trainer = _trainer(hf, tmp_path, _model(hf), cb, max_grad_norm=0.0, optim=optim)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**66)
    try:
        trainer.train()
    finally:
        cb.close()  # train() raised (the xfail case): the Trainer calls no callback then
    assert _errors(cb.findings) == [], [f.message for f in cb.findings]
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    skips = [r for r in records if r["type"] == "amp_skip"]
    assert 1 <= len(skips) < STEPS
    assert records[-1]["type"] == "summary" and records[-1]["amp_skips"] == len(skips)


# -- planted bugs -----------------------------------------------------------------------------


def _detach_block0(model):
    def hook(module, args, out):
        if isinstance(out, tuple):
            return (out[0].detach(),) + out[1:]
        return out.detach()

    return model.transformer.h[0].register_forward_hook(hook)


def test_detached_block_is_missing_grad(hf, tmp_path):
    model = _model(hf)
    _detach_block0(model)
    cb = hf.Callback(policy="record", summary=False)
    _trainer(hf, tmp_path, model, cb, evaluate=True).train()
    missing = {f.tensor for f in cb.findings if f.kind == "missing_grad"}
    assert "transformer.h.0.attn.c_attn.weight" in missing, _kinds(cb.findings)
    assert "transformer.wpe.weight" in missing
    assert not any(t.startswith("transformer.h.1.") for t in missing)  # after the detach


def test_policy_raise_leaves_train_and_next_train_reattaches(hf, tmp_path):
    model = _model(hf)
    handle = _detach_block0(model)
    cb = hf.Callback(policy="raise", summary=False)
    with pytest.raises(trainsan.TrainingBugError) as ei:
        _trainer(hf, tmp_path, model, cb).train()
    assert ei.value.finding.kind == "missing_grad"
    assert not cb.sanitizer.closed  # the Trainer calls no callback when train() raises
    first = cb.sanitizer
    handle.remove()  # fixed: a second train() closes the first sanitizer and attaches anew
    _trainer(hf, tmp_path, model, cb).train()
    assert first.closed and cb.sanitizer is not first and cb.sanitizer.closed
    assert _errors(cb.findings) == [], [f.message for f in cb.findings]


def test_nan_embeddings_are_nonfinite(hf, tmp_path):
    model = _model(hf)
    calls = [0]

    def hook(module, args, out):
        if module.training and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 2 * ACCUM + 1:  # the first micro-batch of step 2
                out = out.clone()
                out[0, 3, 5] = float("nan")
        return out

    model.transformer.wte.register_forward_hook(hook)
    cb = hf.Callback(policy="record", summary=False)
    _trainer(hf, tmp_path, model, cb).train()
    first = {}
    for f in cb.findings:
        first.setdefault(f.kind, f.step)
    assert first.get("nonfinite_loss") == 2, _kinds(cb.findings)
    assert first.get("nonfinite_grad") == 2
    assert "transformer.wte.weight" in {f.tensor for f in cb.findings if f.kind == "nonfinite_grad"}


def test_one_based_labels_raise_before_the_loss(hf, tmp_path):
    """labels + 1: the largest token id becomes VOCAB, out of range for the cross entropy inside
    the model's loss; policy "raise" raises before the op runs."""
    cb = hf.Callback(policy="raise", summary=False)
    with pytest.raises(trainsan.TrainingBugError) as ei:
        _trainer(hf, tmp_path, _model(hf), cb, label_shift=1).train()
    f = ei.value.finding
    assert f.kind == "label_range" and f.step == 0
    assert "1-based" in f.message, f.message
    cb.close()


class SkipsNoDecayGroup(torch.optim.AdamW):
    """A custom optimizer whose step updates only its first param group."""

    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = groups[:1]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


def test_optimizer_skipping_a_group_is_skipped_step(hf, tmp_path):
    model = _model(hf)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # biases, LayerNorm
    opt = SkipsNoDecayGroup(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    cb = hf.Callback(policy="record", summary=False, overhead_budget=None)
    _trainer(hf, tmp_path, model, cb, optimizer=opt).train()
    skipped = {f.tensor for f in cb.findings if f.kind == "skipped_step"}
    no_decay_names = {n for n, p in model.named_parameters() if p.dim() < 2}
    assert skipped and skipped <= no_decay_names, _kinds(cb.findings)


# -- configuration ----------------------------------------------------------------------------


def test_unknown_option_fails_at_construction(hf):
    with pytest.raises(TypeError, match="polcy"):
        hf.Callback(polcy="raise")


def test_deepspeed_is_refused(hf):
    model = _model(hf)
    cb = hf.Callback()
    args = types.SimpleNamespace(deepspeed="ds_config.json")
    with pytest.raises(RuntimeError, match="DeepSpeed is not supported"):
        cb.on_train_begin(args, None, None, model=model, optimizer=None)
    assert cb.sanitizer is None


def test_data_parallel_wrapper_is_unwrapped(hf):
    model = _model(hf)
    opt = torch.optim.AdamW(model.parameters())
    cb = hf.Callback(summary=False)
    args = types.SimpleNamespace()
    cb.on_train_begin(args, None, None, model=torch.nn.DataParallel(model), optimizer=opt)
    try:
        with pytest.raises(RuntimeError, match="already has a sanitizer"):
            trainsan.attach(model, opt)  # the callback's sanitizer is on the module inside
    finally:
        cb.on_train_end(args, None, None)
    assert cb.sanitizer.closed
