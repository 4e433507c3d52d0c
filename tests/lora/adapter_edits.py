"""Small helpers that copy a PEFT adapter directory and break one thing in it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """Copy ``src`` to ``dst`` with config fields changed (a value of ``...`` deletes the field)."""
    copy_adapter(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def edit_tensors(src: Path, dst: Path, fn) -> Path:
    """Copy ``src`` to ``dst`` with ``fn(dict name -> tensor)`` applied to the weights (in place)."""
    copy_adapter(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst


# ---------------------------------------------------------------------------------------------
# One broken adapter per rejection the manager must refuse: name -> (make(src, dst), message).
# ``src`` is an adapter for the tiny base targeting q_proj and v_proj with r=4.


def _pickle(src, dst):
    copy_adapter(src, dst)
    (dst / "training_args.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/loraplex_pwned'\ntR.")
    return dst


def _not_json(src, dst):
    copy_adapter(src, dst)
    (dst / "adapter_config.json").write_text("{nope")
    return dst


def _set_first(pred, value_fn):
    def fn(t):
        k = sorted(k for k in t if pred(k))[0]
        t[k] = value_fn(t[k])

    return fn


def _header(src, dst, mutate):
    import struct

    copy_adapter(src, dst)
    f = dst / "adapter_model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    header, data, n_override = mutate(header, data)
    body = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", n_override if n_override is not None else len(body)) + body + data)
    return dst


def _outside(header, data):
    name = sorted(k for k in header if k != "__metadata__")[-1]
    header[name]["data_offsets"][1] += 4096
    return header, data, None


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[-1, -1] = float("inf")
    return t


def _rename_layer(t):
    for k in list(t):
        t[k.replace("layers.1.", "layers.5.")] = t.pop(k)


def _drop_b(t):
    del t[sorted(k for k in t if "lora_B" in k)[0]]


def _extra_k(t):
    k = next(k for k in t if "q_proj.lora_A" in k)
    t[k.replace("q_proj", "k_proj")] = t[k].clone()
    b = next(k for k in t if "q_proj.lora_B" in k)
    t[b.replace("q_proj", "k_proj")] = t[b][: t[b].shape[0] // 2].clone()


BAD_ADAPTERS = {
    "pickle": (_pickle, "pickle"),
    "dora": (lambda s, d: edit_config(s, d, use_dora=True), "DoRA"),
    "modules_to_save": (lambda s, d: edit_config(s, d, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (lambda s, d: edit_config(s, d, bias="all"), "bias"),
    "rank_above_max": (lambda s, d: _big_rank(s, copy_adapter(s, d)), "max_lora_rank 8"),
    "target_missing_in_base": (lambda s, d: edit_config(s, d, target_modules=["q_proj", "v_proj", "fc_in"]), "fc_in"),
    "wrong_shape": (
        lambda s, d: edit_tensors(s, d, _set_first(lambda k: "q_proj.lora_A" in k, lambda t: torch_randn(t.shape[0], 96))),
        "shape",
    ),
    "layer_out_of_range": (lambda s, d: edit_tensors(s, d, _rename_layer), "layer 5"),
    "missing_tensor": (lambda s, d: edit_tensors(s, d, _drop_b), "missing tensor"),
    "extra_tensor": (lambda s, d: edit_tensors(s, d, _extra_k), "extra tensors"),
    "nan": (lambda s, d: edit_tensors(s, d, _set_first(lambda k: "lora_A" in k, _nan)), "NaN or Inf"),
    "inf": (lambda s, d: edit_tensors(s, d, _set_first(lambda k: "lora_B" in k, _inf)), "NaN or Inf"),
    "header_malformed": (lambda s, d: _header(s, d, lambda h, data: ({"x": 1}, data, None)), "entry 'x'"),
    "header_oversized": (lambda s, d: _header(s, d, lambda h, data: (h, data, 1 << 40)), "exceeds the cap"),
    "offsets_outside_file": (lambda s, d: _header(s, d, _outside), "outside the file"),
    "config_not_json": (_not_json, "not valid JSON"),
    "config_missing_field": (lambda s, d: edit_config(s, d, target_modules=...), "'target_modules' is missing"),
}


def torch_randn(*shape):
    import torch

    return torch.randn(*shape)


def _big_rank(src, dst):
    """Rewrite ``dst`` (already a copy) as a valid rank-16 adapter: above a max_lora_rank of 8."""
    import torch

    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["r"], cfg["rank_pattern"] = 16, {}
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    for k, t in list(tensors.items()):
        tensors[k] = torch.randn(16, t.shape[1]) if "lora_A" in k else torch.randn(t.shape[0], 16)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst
