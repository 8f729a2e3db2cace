"""Private LoRA: adapters on every decoder projection, owned per decoder segment.

Each LoRA parameter belongs to exactly one party, decided by its decoder-layer
index and the cuts (vlm.cuts). A party saves, sends and restores only its own
subset; the others' adapters are never touched.

One frozen base can carry several named adapter sets (peft's `add_adapter`), e.g. one
per virtual client served by a process; every function here reads or writes one set,
`adapter` ("default": the one `apply_lora` made).
"""

import re
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from vlm.cuts import LayerSegment

# peft fullmatches a string target against module names. A plain list of projection
# names would also wrap CLIP's q/k/v/out projections; this only matches the decoder.
LORA_TARGET_MODULES = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
_DECODER_LAYER_INDEX = re.compile(r"language_model\.layers\.(\d+)\.")
_METADATA_OWNER = "owner"
DEFAULT_ADAPTER = "default"
_METADATA_LAYERS = "layers"


def apply_lora(
    model: nn.Module, *, rank: int = 32, alpha: float | None = None, dropout: float = 0.0
) -> PeftModel:
    """Wrap `model` with LoRA on q, k, v, o, gate, up, down of every decoder layer.

    The base (vision tower, projector, embeddings, decoder, LM head) is frozen.
    `alpha` defaults to 2 × rank, the LLaVA-1.5 LoRA recipe's ratio (r=128, alpha=256).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank={rank} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout={dropout} must be in [0, 1)")
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=dropout,
        target_modules=LORA_TARGET_MODULES,
        bias="none",
    )
    with warnings.catch_warnings():
        # peft 0.21 calls a transformers 5 method deprecated in favour of another; not actionable here.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def decoder_layer_index(name: str) -> int:
    """Decoder layer a LoRA parameter (or peft state-dict key) sits in."""
    match = _DECODER_LAYER_INDEX.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not inside a decoder layer (language_model.layers.<i>)")
    return int(match.group(1))


def add_adapter(model: PeftModel, name: str, initial: dict[str, torch.Tensor]) -> None:
    """A second adapter set `name` on the same base, configured like "default" and holding
    `initial` (peft-format keys); adapters on meta-device layers stay empty."""
    if name not in model.peft_config:
        # Its random initialisation is overwritten below; it must not move the process's RNG.
        with torch.random.fork_rng(devices=[]):
            model.add_adapter(name, model.peft_config[DEFAULT_ADAPTER])
        # peft leaves a new adapter on the CPU where the layer it wraps is on meta.
        for module in model.modules():
            if isinstance(module, LoraLayer) and module.get_base_layer().weight.device.type == "meta":
                module.lora_A[name].to("meta")
                module.lora_B[name].to("meta")
    result = set_peft_model_state_dict(model, initial, adapter_name=name)
    if result.unexpected_keys:
        raise ValueError(f"peft did not place these adapter keys: {result.unexpected_keys[:4]}")


def lora_parameters(model: nn.Module, adapter: str = DEFAULT_ADAPTER) -> dict[str, nn.Parameter]:
    marker = re.compile(rf"\.lora_[AB]\.{re.escape(adapter)}\.")
    return {name: parameter for name, parameter in model.named_parameters() if marker.search(name)}


def owner_lora_parameters(
    model: nn.Module, segment: LayerSegment, adapter: str = DEFAULT_ADAPTER
) -> dict[str, nn.Parameter]:
    """The LoRA parameters `segment.owner` trains (its optimiser's parameter list)."""
    return {
        name: parameter
        for name, parameter in lora_parameters(model, adapter).items()
        if decoder_layer_index(name) in segment
    }


def owner_state_dict(model: PeftModel, segment: LayerSegment, adapter: str = DEFAULT_ADAPTER) -> dict[str, torch.Tensor]:
    """The owner's adapters in peft's adapter-file key format (detached copies): the
    parameter names without the adapter's name, as get_peft_model_state_dict writes them
    (which builds the whole model's state dict to get there)."""
    return {
        name.replace(f".{adapter}.", "."): parameter.detach().clone()
        for name, parameter in owner_lora_parameters(model, segment, adapter).items()
    }


def load_owner_state_dict(
    model: PeftModel, segment: LayerSegment, state: dict[str, torch.Tensor], adapter: str = DEFAULT_ADAPTER
) -> None:
    """Restore exactly the owner's adapters; the other owners' adapters stay as they are.

    The keys must be the owner's full set: a partial or foreign state would leave
    stale values or overwrite another party's adapters without notice.
    """
    expected = {
        key for key in get_peft_model_state_dict(model, adapter_name=adapter) if decoder_layer_index(key) in segment
    }
    foreign = sorted(key for key in state if key not in expected)
    missing = sorted(expected - state.keys())
    if foreign or missing:
        raise ValueError(
            f"state for owner {segment.owner!r} (layers [{segment.start}, {segment.stop})) does not match its "
            f"adapters: {len(foreign)} foreign keys (e.g. {foreign[:2]}), {len(missing)} missing (e.g. {missing[:2]})"
        )
    result = set_peft_model_state_dict(model, state, adapter_name=adapter)
    if result.unexpected_keys:
        raise ValueError(f"peft did not place these adapter keys: {result.unexpected_keys[:4]}")


def save_owner_state(model: PeftModel, segment: LayerSegment, path: str | Path) -> None:
    """Write the owner's adapters to a safetensors file tagged with the owner and its layers."""
    tensors = {key: value.contiguous() for key, value in owner_state_dict(model, segment).items()}
    save_file(
        tensors,
        str(path),
        metadata={_METADATA_OWNER: segment.owner, _METADATA_LAYERS: f"{segment.start}-{segment.stop}"},
    )


def load_owner_state(model: PeftModel, segment: LayerSegment, path: str | Path) -> None:
    """Read an owner's adapters written by save_owner_state; refuses a file of another owner or range."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    expected = {_METADATA_OWNER: segment.owner, _METADATA_LAYERS: f"{segment.start}-{segment.stop}"}
    found = {key: metadata.get(key) for key in expected}
    if found != expected:
        raise ValueError(f"{path} holds adapters of {found}, not of {expected}")
    load_owner_state_dict(model, segment, load_file(str(path)))
