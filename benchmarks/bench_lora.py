"""The ``lora`` section of ``bench_engine.py``: multi-LoRA throughput, one run.

    .venv/bin/python benchmarks/bench_engine.py --section lora --dtypes bfloat16

SmolLM2-135M-Instruct, ``--num-adapters`` (default 32) distinct adapters made with peft on the
real base shapes (random init, ``init_lora_weights=False``; ranks 8 and 16 alternating, all seven
projections; cached under ``<home>/bench_adapters``), ``--num-requests`` prompts spread over
them round-robin, ``--output-tokens`` greedy tokens each (EOS ignored). Prints, per dtype:

* loraplex with adapters (one ``generate`` call, every adapter in a device slot after warm-up),
* the same engine on the base model, same prompts,
* PEFT's mixed-adapter ``generate(adapter_names=...)`` on the same prompts, one left-padded batch,

each warmed up once with the full workload, then ``--repeats`` rounds in turn (medians, and the
median of per-round ratios).

Prefix caching is on unless ``--prefix-caching off``: base requests then share the chat
template's prefix blocks with each other, adapter requests only with requests of the same
adapter (KV depends on the adapter), so the adapters/base ratio includes that difference.

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


def make_engine(args, dtype: str, adapter_dirs: list[Path], num_prompts: int):
    """An engine with every adapter registered and in a device slot: (llm, names, seconds to register)."""
    from loraplex import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=dtype, home=Path(args.home).expanduser(), max_model_len=args.max_model_len,
              max_num_seqs=max(256, num_prompts), max_loras=len(adapter_dirs), max_lora_rank=16,
              enable_prefix_caching=args.prefix_caching != "off")
    start = time.perf_counter()
    names = [f"a{i}" for i in range(len(adapter_dirs))]
    for name, d in zip(names, adapter_dirs):
        llm.add_adapter(name, str(d))
    register_s = time.perf_counter() - start
    llm.generate([[1, 2, 3]] * len(names), SamplingParams(temperature=0.0, max_tokens=2), adapters=names)
    return llm, names, register_s


def section_lora(args) -> list:
    import torch
    from bench_engine import Row, alternate, chat_token_ids, engine_runner, hf_generate_runner, make_prompts, median
    from bench_engine import ratio_median

    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    home = Path(args.home).expanduser()
    model_dir, _name = resolve_model_dir(args.model, home)
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(args.num_requests))
    num = getattr(args, "num_adapters", 32)
    root = home / "bench_adapters" / f"{model_dir.name}-{num}"
    peft_model, names = make_adapters(model_dir, root, num)
    print(f"# lora: {len(prompt_ids)} requests over {num} adapters (r8/r16, all 7 projections), "
          f"{args.output_tokens} output tokens each; warm-up + {args.repeats} alternating rounds", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        llm, names, register_s = make_engine(args, dtype, [root / n for n in names], len(prompt_ids))
        adapters = [names[i % len(names)] for i in range(len(prompt_ids))]
        peft_model.to(getattr(torch, dtype))
        print(f"## {dtype}", flush=True)
        rates = alternate({
            "lora": engine_runner(llm, prompt_ids, args.output_tokens, adapters=adapters),
            "base": engine_runner(llm, prompt_ids, args.output_tokens),
            "peft": hf_generate_runner(peft_model, prompt_ids, args.output_tokens, adapter_names=adapters),
        }, args.repeats)
        lora, base, peft = rates["lora"], rates["base"], rates["peft"]
        caching = "off" if args.prefix_caching == "off" else "on"
        note = (f"engine base {median(base):.1f} tok/s; lora/base {ratio_median(lora, base):.2f}x (target 0.7); "
                f"prefix caching {caching}; "
                f"registering {num} adapters {register_s:.1f}s")
        rows.append(Row("lora (vs PEFT mixed)", dtype, median(lora), median(peft), ratio_median(lora, peft), note))
        del llm
        gc.collect()
    return rows


if __name__ == "__main__":  # standalone: same options as bench_engine.py
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_engine

    bench_engine.SECTIONS.setdefault("lora", section_lora)
    sys.exit(bench_engine.main(["--section", "lora", *sys.argv[1:]]))
