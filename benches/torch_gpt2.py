#!/usr/bin/env python3
"""PyTorch eager baseline for meshtrain's GPU training benchmark (issue #6).

Trains the same GPT-2 as meshtrain (tied embeddings, learned positions, pre-LayerNorm blocks,
tanh GELU, vocabulary padded to a multiple of 128 with padded logits excluded from the loss) on
random tokens in plain eager PyTorch: bf16 autocast with fp32 master weights, fused AdamW, no
torch.compile and no flash-attention kernel choice beyond what `scaled_dot_product_attention`
picks by itself. Prints one JSON line with tokens/s, TFLOP/s and MFU, counted with the same
FLOPs per token as meshtrain's metrics (src/metrics.rs): 6*N + 12*L*C*T with N = 12*L*C^2 + V*C
(matmul weights only, unpadded vocabulary).

    python3 benches/torch_gpt2.py --size d12 --batch 8 --seq-len 1024 --steps 30 --peak-tflops 989
    python3 benches/torch_gpt2.py --size tiny --device cpu --steps 3   # smoke test anywhere
"""

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# name: (layers, heads, width, vocab, max positions), as in src/model/mod.rs
SIZES = {
    "tiny": (2, 4, 64, 256, 64),
    "d12": (12, 12, 768, 50257, 1024),
    "d24": (24, 16, 1024, 50257, 1024),
    "d36": (36, 20, 1280, 50257, 1024),
    "d48": (48, 25, 1600, 50257, 1024),
}


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.nh, c // self.nh)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, heads, width, vocab, max_t):
        super().__init__()
        self.vocab = vocab
        self.padded = (vocab + 127) // 128 * 128
        self.wte = nn.Embedding(self.padded, width)
        self.wpe = nn.Embedding(max_t, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        logits = logits[..., : self.vocab]  # padded columns never enter the loss
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="d12", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=None, help="for MFU (H100 SXM bf16 dense: 989)")
    args = ap.parse_args()

    layers, heads, width, vocab, max_t = SIZES[args.size]
    t = min(args.seq_len, max_t)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = Gpt(layers, heads, width, vocab, max_t).to(dev)
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * (12 * layers * width**2 + vocab * width) + 12 * layers * width * t
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    timed, losses = 0.0, []
    for step in range(args.steps):
        idx = torch.randint(0, vocab, (args.batch, t + 1), device=dev)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            timed += time.perf_counter() - t0
        losses.append(loss.item())
    steps = max(args.steps - args.warmup, 0)
    tokens_per_s = steps * args.batch * t / timed if timed > 0 else float("nan")
    tflops = tokens_per_s * flops_per_token / 1e12
    out = {
        "impl": "pytorch-eager",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "size": args.size,
        "params": n_params,
        "batch": args.batch,
        "seq_len": t,
        "timed_steps": steps,
        "tokens_per_s": tokens_per_s,
        "model_tflops": tflops,
        "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
