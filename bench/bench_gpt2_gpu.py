"""Sanitizer overhead on a GPT-2-small-sized model's training step (bf16 autocast, one GPU).

Contenders, interleaved in rounds on the same model and optimizer so that clocks and caches
are shared: the plain step, TrainSan at default options (asynchronous checks, one step late) in
its steady state (the sanitizer is attached, then 11 untimed steps run past the default op-audit
window of 10 steps), TrainSan with ``sync=True``, and TrainSan auditing every op of every step
(``audit_every=1``: the cost of an audited step). Each round runs ``--steps`` steps and is timed
with CUDA events; the table reports medians over rounds and the ratio to the plain step.

    python3 bench/bench_gpt2_gpu.py                 # GPT-2 small: 12 x 768, seq 1024, batch 8
    python3 bench/bench_gpt2_gpu.py --tiny --device cpu   # smoke test of the script itself

Goal (issue): default options at most 1.03x the plain step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


class GPT(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, seq, dropout=0.1, tied=True):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.01)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight  # as in GPT-2
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small config (smoke test)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpt2_gpu: no CUDA device visible; nothing to measure (use --device cpu --tiny "
              "to smoke-test the script)")
        return 0
    import trainsan

    dev = torch.device(args.device)
    cfg = dict(vocab=512, d=64, layers=2, heads=4, seq=64) if args.tiny else dict(
        vocab=50257, d=768, layers=12, heads=12, seq=1024)
    torch.manual_seed(0)
    model = GPT(**cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    nparams = sum(q.numel() for q in model.parameters())
    amp_dtype = torch.bfloat16
    batches = [torch.randint(0, cfg["vocab"], (args.batch, cfg["seq"] + 1), device=dev)
               for _ in range(4)]

    def step(i):
        b = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp_dtype):
            logits = model(b[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), b[:, 1:].reshape(-1))
        loss.backward()
        opt.step()

    def timed_round(i0):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for i in range(args.steps):
                step(i0 + i)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / args.steps
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(i0 + i)
        return (time.perf_counter() - t0) * 1e3 / args.steps

    # name -> (attach options or None, untimed steps after attach)
    contenders = {
        "plain": (None, 0),
        "trainsan default": (dict(policy="record"), 11),
        "trainsan sync=True": (dict(policy="record", sync=True), 11),
        "trainsan audited step": (dict(policy="record", audit_first_steps=0, audit_every=1), 1),
        # Overflow provenance (issue 12): off, and on every step (the default flags one in 20).
        "trainsan no provenance": (dict(policy="record", provenance_every=0, provenance_rearm=0),
                                   11),
        "provenance every step": (dict(policy="record", provenance_every=1), 11),
    }
    for i in range(3):  # warm-up (allocator, kernels, autotuning)
        step(i)
    times = {k: [] for k in contenders}
    findings = {}
    for r in range(args.rounds):
        for name, (opts, warm) in contenders.items():
            san = trainsan.attach(model, opt, **opts) if opts is not None else None
            try:
                for i in range(warm):  # snapshot, first checks, the default audit window
                    step(i)
                times[name].append(timed_round(r * args.steps))
            finally:
                if san is not None:
                    san.close()
                    findings[name] = [f.kind for f in san.findings]
    base = statistics.median(times["plain"])
    print(f"GPT model: {nparams / 1e6:.1f}M parameters, batch {args.batch} x {cfg['seq']} tokens, "
          f"bf16 autocast, AdamW, device {dev} "
          f"({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'})")
    print(f"{'contender':22s} {'ms/step (median)':>17s} {'ratio':>7s}  rounds")
    for name in contenders:
        med = statistics.median(times[name])
        print(f"{name:22s} {med:17.3f} {med / base:7.3f}x  "
              + " ".join(f"{t:.2f}" for t in times[name]))
    for name, kinds in findings.items():
        if kinds:
            print(f"note: {name} reported {sorted(set(kinds))} on this synthetic run")
    ratio = statistics.median(times["trainsan default"]) / base
    print(f"goal: default <= 1.03x plain -> {'met' if ratio <= 1.03 else 'MISSED'} ({ratio:.3f}x)")
    off = statistics.median(times["trainsan no provenance"])
    prov = statistics.median(times["trainsan default"]) / off - 1
    every = statistics.median(times["provenance every step"]) / off - 1
    print(f"goal: provenance at defaults <= 3% of the step -> {'met' if prov <= 0.03 else 'MISSED'} "
          f"({prov * 100:.2f}%; every step flagged: {every * 100:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
