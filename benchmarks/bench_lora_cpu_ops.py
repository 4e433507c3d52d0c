"""Per-call time of the CPU LoRA shrink/expand for a decode step of SmolLM2-135M shapes:
64 tokens over 32 adapters (ranks 8/16 alternating), fp32 stacks, bf16 activations.

    .venv/bin/python benchmarks/bench_lora_cpu_ops.py
"""
import sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.lora_cpu import lora_shrink_cpu, lora_expand_cpu
torch.manual_seed(0)
T, L, r = 64, 32, 16
slots = [i % L for i in range(T)]
perm = sorted(range(T), key=lambda i: slots[i])
starts=[0]; segslot=[]
for s in range(L):
    starts.append(starts[-1] + slots.count(s)); segslot.append(s)
ranks = [8 if s % 2 else 16 for s in range(L)]
def meta():
    return LoRABatchMeta(torch.tensor(perm), torch.tensor(starts,dtype=torch.int32), torch.tensor(segslot,dtype=torch.int32),
        torch.tensor(ranks,dtype=torch.int32), T, L, 2, 16, starts, segslot, ranks)
for name,(inn, outs) in {"qkv":(576,(576,192,192)),"o":(576,(576,)),"gate_up":(576,(1536,1536)),"down":(1536,(576,))}.items():
    S=len(outs); a=torch.randn(S,L,r,inn); b=torch.randn(L,sum(outs),r); sc=torch.rand(S,L)
    offs=[0]
    for o in outs: offs.append(offs[-1]+o)
    x=torch.randn(T,inn,dtype=torch.bfloat16); y=torch.zeros(T,sum(outs),dtype=torch.bfloat16)
    m=meta(); out=torch.empty(S,T,r)
    for _ in range(3): lora_shrink_cpu(x,a,m,out); lora_expand_cpu(out,b,sc,tuple(offs),m,y)
    n=50; t0=time.perf_counter()
    for _ in range(n): lora_shrink_cpu(x,a,m,out)
    t1=time.perf_counter()
    for _ in range(n): lora_expand_cpu(out,b,sc,tuple(offs),m,y)
    t2=time.perf_counter()
    print(name, f"shrink {(t1-t0)/n*1e3:.2f} ms expand {(t2-t1)/n*1e3:.2f} ms")
