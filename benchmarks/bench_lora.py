"""The ``lora`` section of ``bench_engine.py``: multi-LoRA throughput, one run.

    .venv/bin/python benchmarks/bench_engine.py --section lora --dtypes bfloat16

SmolLM2-135M-Instruct, ``--num-adapters`` (default 32) distinct adapters made with peft on the
real base shapes (random init, ``init_lora_weights=False``; ranks 8 and 16 alternating, all seven
projections; cached under ``<home>/bench_adapters``), ``--num-requests`` prompts spread over
them round-robin, ``--output-tokens`` greedy tokens each (EOS ignored). Prints, per dtype:

* loraplex with adapters (one ``generate`` call, every adapter in a device slot after warm-up),
* the same engine on the base model, same prompts,
* PEFT's mixed-adapter ``generate(adapter_names=...)`` on the same prompts, one left-padded batch.

Targets (2-core CPU): adapters >= 0.7 x engine base, >= 1.7 x PEFT.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path


def make_adapters(model_dir: Path, root: Path, num: int):
    """A ``PeftModel`` (fp32) holding ``num`` adapters, each also saved as ``root/a{i}``."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = [f"a{i}" for i in range(num)]
    if all((root / n / "adapter_model.safetensors").exists() for n in names):
        model = PeftModel.from_pretrained(base, str(root / names[0]), adapter_name=names[0])
        for n in names[1:]:
            model.load_adapter(str(root / n), adapter_name=n)
        return model.eval(), names
    model = None
    for i, n in enumerate(names):
        cfg = LoraConfig(r=8 if i % 2 else 16, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(i)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=n)
        else:
            model.add_adapter(n, cfg)
        model.save_pretrained(str(root / n), selected_adapters=[n])
        # save_pretrained nests a non-default adapter under its name: flatten to root/n
        nested = root / n / n
        if nested.is_dir():
            for f in nested.iterdir():
                f.replace(root / n / f.name)
            nested.rmdir()
    return model.eval(), names


def bench_peft(model, prompt_ids: list[list[int]], adapter_names: list[str], output_tokens: int, pad: int) -> float:
    import torch

    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=pad, max_new_tokens=output_tokens, min_new_tokens=output_tokens)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:2], attention_mask=attention_mask[:2], adapter_names=adapter_names[:2],
                       **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, adapter_names=adapter_names, **kwargs)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * out.shape[0] / elapsed


def bench_engine_lora(args, dtype: str, prompt_ids, adapter_dirs: list[Path]) -> tuple[float, float, float]:
    """(tok/s with adapters, tok/s base, seconds to register all adapters) on one engine."""
    from loraplex import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=dtype, home=Path(args.home).expanduser(), max_model_len=args.max_model_len,
              max_num_seqs=max(256, len(prompt_ids)), max_loras=len(adapter_dirs), max_lora_rank=16)
    start = time.perf_counter()
    names = [f"a{i}" for i in range(len(adapter_dirs))]
    for name, d in zip(names, adapter_dirs):
        llm.add_adapter(name, str(d))
    register_s = time.perf_counter() - start
    adapters = [names[i % len(names)] for i in range(len(prompt_ids))]
    # warm-up: every adapter once (fills the device slots), and the base path
    warm = [prompt_ids[i % len(prompt_ids)] for i in range(len(names))]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), adapters=names)
    llm.generate(prompt_ids[:2], SamplingParams(temperature=0.0, max_tokens=2))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    rates = {}
    for label, ads in (("lora", adapters), ("base", None)):
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params, adapters=ads)
        rates[label] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
    del llm
    gc.collect()
    return rates["lora"], rates["base"], register_s


def section_lora(args) -> list:
    import torch
    from bench_engine import Row, chat_token_ids, make_prompts

    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    home = Path(args.home).expanduser()
    model_dir, _name = resolve_model_dir(args.model, home)
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(args.num_requests))
    num = getattr(args, "num_adapters", 32)
    root = home / "bench_adapters" / f"{model_dir.name}-{num}"
    peft_model, names = make_adapters(model_dir, root, num)
    print(f"# lora: {len(prompt_ids)} requests over {num} adapters (r8/r16, all 7 projections), "
          f"{args.output_tokens} output tokens each", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        lora_tps, base_tps, register_s = bench_engine_lora(args, dtype, prompt_ids, [root / n for n in names])
        print(f"  engine+lora  {dtype:9s} {lora_tps:8.1f} tok/s", flush=True)
        print(f"  engine base  {dtype:9s} {base_tps:8.1f} tok/s", flush=True)
        peft_model.to(getattr(torch, dtype))
        pad = peft_model.generation_config.pad_token_id
        adapter_names = [names[i % len(names)] for i in range(len(prompt_ids))]
        peft_tps = bench_peft(peft_model, prompt_ids, adapter_names, args.output_tokens, pad if pad is not None else 0)
        print(f"  peft mixed   {dtype:9s} {peft_tps:8.1f} tok/s", flush=True)
        note = (f"engine base {base_tps:.1f} tok/s; lora/base {lora_tps / base_tps:.2f}x (target 0.7); "
                f"registering {num} adapters {register_s:.1f}s")
        rows.append(Row("lora (vs PEFT mixed)", dtype, lora_tps, peft_tps, note))
    return rows


if __name__ == "__main__":  # standalone: same options as bench_engine.py
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_engine

    bench_engine.SECTIONS.setdefault("lora", section_lora)
    sys.exit(bench_engine.main(["--section", "lora", *sys.argv[1:]]))
