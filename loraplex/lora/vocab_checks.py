"""The checks of an adapter's vocabulary modules (embed_tokens, lm_head) that only their
tensors can answer: the base-weight copies PEFT saves beside them, a vocabulary resized by added
tokens, and LoRAs that ``ensure_weight_tying`` says are tied. Called by ``peft_format.validate_adapter``."""

from __future__ import annotations

import torch

from loraplex.lora.adapter_config import LoRAConfigView
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.module_match import TENSOR_PREFIX
from loraplex.lora.spec import LoRATargetSpec
from loraplex.lora.vocab_names import EMBED, base_copy_module


def base_copy_key(name: str, tensor: torch.Tensor, spec: LoRATargetSpec) -> str | None:
    """The module key when ``name`` is the base weight PEFT saves beside a targeted vocabulary
    module (see ``vocab_names``), after checking its shape; else None."""
    if not name.startswith(TENSOR_PREFIX):
        return None
    found = base_copy_module(name[len(TENSOR_PREFIX) :])
    if found is None:
        return None
    mod, key = found
    if mod not in spec.vocab_shapes:
        raise InvalidAdapterError(
            f"tensor {name!r} is a weight of {mod!r}, which base model {spec.model_name!r} does not serve LoRA on"
        )
    want = (spec.vocab_size, spec.hidden_size)
    if tuple(tensor.shape) != want:
        rows = tensor.shape[0] if tensor.dim() == 2 else None
        if rows is not None and rows != spec.vocab_size and tensor.shape[1] == spec.hidden_size:
            raise InvalidAdapterError(_resized_vocab(name, rows, spec))
        raise InvalidAdapterError(f"{name!r} has shape {list(tensor.shape)}, base model needs {list(want)}")
    return key


def check_tied_vocab_loras(cfg: LoRAConfigView, spec: LoRATargetSpec, embed: dict[str, str], head: dict[str, str],
                            tensors: dict[str, torch.Tensor]) -> None:
    """With ``ensure_weight_tying`` on a model whose lm_head is its embedding, PEFT ties the two
    LoRAs when it loads the adapter, and the saved lm_head tensors overwrite the embedding's. A
    file PEFT saved so holds each as the other's transpose; one that does not (a config edited by
    hand) PEFT would serve with lm_head's LoRA on the embedding too, unlike its own tensors say:
    refused, as the edit that targets lm_head alone is (``module_match.add_tied_lm_head``)."""
    if not (cfg.raw.get("ensure_weight_tying") and spec.tied_embeddings):
        return
    pairs = ((tensors[head["A"]], tensors[embed["B"]]), (tensors[head["B"]], tensors[embed["A"]]))
    if all(h.shape == e.T.shape and torch.equal(h.double(), e.T.double()) for h, e in pairs):
        return
    raise InvalidAdapterError(
        f"adapter_config.json: ensure_weight_tying is set and base model {spec.model_name!r} ties lm_head to "
        "embed_tokens, but the saved lm_head LoRA is not the embedding's transposed, as PEFT saves tied LoRAs: "
        "loading it, PEFT would put lm_head's LoRA on the embedding too. Save the adapter again with PEFT, or "
        "set ensure_weight_tying to false to serve the two LoRAs as saved"
    )


def check_vocab_shapes(
    mod: str, names: dict[str, str], a: torch.Tensor, b: torch.Tensor, rank: int, spec: LoRATargetSpec
) -> None:
    """A vocabulary-sized dimension that differs from the base vocabulary: the adapter was
    trained with added tokens, which cannot be served (vLLM dropped extra-vocab LoRA too)."""
    if mod == EMBED:  # lora_embedding_A [rank, vocab]
        name, t, dim = names["A"], a, 1
    else:  # lm_head lora_B [vocab, rank]
        name, t, dim = names["B"], b, 0
    if t.dim() == 2 and t.shape[1 - dim] == rank and t.shape[dim] != spec.vocab_size:
        raise InvalidAdapterError(_resized_vocab(name, int(t.shape[dim]), spec))


def _resized_vocab(name: str, vocab: int, spec: LoRATargetSpec) -> str:
    return (
        f"tensor {name!r} is for a vocabulary of {vocab} tokens, but base model {spec.model_name!r} has "
        f"{spec.vocab_size}: adapters trained with a resized vocabulary (added tokens) are not served"
    )


def base_copies_warning(base_copies: dict[str, str]) -> str:
    return (
        f"ignored the base-model weights saved with the adapter for {', '.join(sorted(base_copies))} "
        "(PEFT's save_embedding_layers): LoRA training leaves them frozen, so the base model's own are used"
    )
