"""What the LoRA code needs to know about the base model, and how callers name an adapter.
Plain data: the model produces a ``LoRATargetSpec``; the validator and slot pool consume it."""

from __future__ import annotations

from dataclasses import dataclass, field

# PEFT module names that loraplex can serve, in the order the packed projections use them;
# qkv_proj and gate_up_proj are Phi-3's fused modules (a model has either those or their parts);
# the shared_expert.* ones are Qwen2-MoE's shared expert (below ``mlp.``)
TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
)
# Qwen2-MoE's shared expert as loraplex packs it (after PACKED_MODULES' four)
SHARED_EXPERT_PACKED: dict[str, tuple[str, ...]] = {
    "shared_expert.gate_up_proj": ("shared_expert.gate_proj", "shared_expert.up_proj"),
    "shared_expert.down_proj": ("shared_expert.down_proj",),
}

# Modules outside the layers, keyed by the vocabulary: the token embedding and the output layer
# (PEFT's ``EMBEDDING_LAYER_NAMES``). They come after TARGET_MODULES in an adapter's targets.
VOCAB_TARGETS = ("embed_tokens", "lm_head")

# loraplex's packed projections and the PEFT modules (slices) each holds, in slice order, for a
# model with separate q/k/v and gate/up linears (Llama's layout).
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LoRATargetSpec:
    """Shapes of the base model's LoRA-targetable linears: ``module -> (in_features, out_features)``
    for each of its HF module names (in ``TARGET_MODULES``), identical in every layer of a
    Llama-family decoder; ``packed_modules``: loraplex's packed projections and the modules each
    holds as slices (Phi-3: each fused module is the one slice of its projection).

    ``unserved_module_prefixes``: module-name prefixes (as PEFT names modules, after
    ``base_model.model.``) of base-model parts that loraplex does not run, such as a multimodal
    checkpoint's vision tower when only its text model is served. LoRA on those modules can
    never change an output, so an adapter carrying some is accepted with a warning.

    ``vocab_size`` / ``hidden_size``: the shapes of the embedding and the output layer, for LoRA
    on ``embed_tokens`` and ``lm_head`` (``VOCAB_TARGETS``); 0 when not known, which refuses
    such adapters. ``tied_embeddings``: lm_head shares the embedding's weight (PEFT's
    ``ensure_weight_tying`` then ties their LoRA too).

    ``module_layers`` / ``moe_module_names``: see the fields (mixture-of-experts models)."""

    model_name: str
    num_layers: int
    module_shapes: dict[str, tuple[int, int]]
    packed_modules: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(PACKED_MODULES))
    unserved_module_prefixes: tuple[str, ...] = ()
    vocab_size: int = 0
    hidden_size: int = 0
    tied_embeddings: bool = False
    # modules present in some layers only (an MoE model's dense MLP layers): module -> its layers;
    # a module not listed here is in every layer
    module_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # module-name segments of an MoE model's experts / routers / shared expert (below
    # ``layers.N.``): LoRA on them is refused, but for expert LoRA where ``experts`` serves it
    moe_module_names: tuple[str, ...] = ()
    # LoRA on the experts of an MoE model's sparse layers (``ExpertShapes``); None: refused
    experts: "ExpertShapes | None" = None

    def module_in_layer(self, module: str, layer: int) -> bool:
        """Whether layer ``layer`` has the targetable ``module``."""
        layers = self.module_layers.get(module)
        return module in self.module_shapes and (layers is None or layer in layers)

    def num_layers_with(self, module: str) -> int:
        """How many layers have the targetable ``module``."""
        layers = self.module_layers.get(module)
        return self.num_layers if layers is None else len(layers)

    @property
    def vocab_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each vocabulary target, in PEFT's terms: the
        embedding maps ``vocab`` ids to ``hidden`` (``lora_embedding_A [r, vocab]``,
        ``lora_embedding_B [hidden, r]``); lm_head maps ``hidden`` to ``vocab`` logits."""
        if self.vocab_size <= 0 or self.hidden_size <= 0:
            return {}
        return {"embed_tokens": (self.vocab_size, self.hidden_size), "lm_head": (self.hidden_size, self.vocab_size)}


@dataclass(frozen=True)
class ExpertShapes:
    """The experts of an MoE model's sparse layers, as LoRA on them sees them: ``num_experts``
    SwiGLU experts of ``hidden`` -> ``inter`` in each layer of ``layers``; ``style`` names the
    per-expert modules (``"mixtral"``: ``block_sparse_moe.experts.{e}.w1/w3/w2``; ``"qwen"``:
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``). ``enabled``: the engine holds slot room for
    expert LoRA (``EngineConfig.enable_expert_lora``); when False such adapters are refused
    saying how to turn it on."""

    num_experts: int
    hidden: int
    inter: int
    layers: tuple[int, ...]
    style: str = "qwen"
    enabled: bool = False

    @property
    def part_names(self) -> dict[str, str]:
        """``gate`` / ``up`` / ``down`` -> the per-expert module name of this family."""
        if self.style == "mixtral":
            return {"gate": "w1", "up": "w3", "down": "w2"}
        return {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def part_shape(self, part: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one expert's ``gate`` / ``up`` / ``down``."""
        return (self.inter, self.hidden) if part == "down" else (self.hidden, self.inter)


@dataclass(frozen=True)
class AdapterRef:
    """A resolved adapter version to run a request with.

    ``path`` is a local PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).
    ``content_hash`` is the version's identity (sha256 of canonical config and weights); when the
    registry already knows it, it is passed along and verified on load, else it is computed.
    ``name`` is for display only (metrics, logs), never for caching.
    """

    name: str
    path: str
    content_hash: str | None = None


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline ``LoRARequest(lora_name, lora_int_id, lora_path)``, so vLLM scripts run on
    ``LLM.generate(..., lora_request=...)``. The adapter is ``lora_path`` (a PEFT directory), or
    ``lora_name`` when that is a name registered with ``LLM.add_adapter``. ``lora_int_id`` is
    accepted and unused: loraplex tells adapters apart by the content hash of their files."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    @property
    def adapter(self) -> str:
        return self.lora_path or self.lora_name
