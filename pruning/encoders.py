"""The two frozen encoders QPriv-VL adds to LLaVA: a CLIP text tower and DINOv2.

The CLIP text tower turns a question into one vector (the final-layer-norm state at
its end-of-text token, which is CLIPTextModel's pooled output); DINOv2 turns an image
into patch features on its own grid. Neither trains in QPriv-VL's own stages.

Real weights (`llava-1.5-7b`: openai/clip-vit-large-patch14-336 and facebook/dinov2-small)
come from a local folder or the local HF cache and fail in milliseconds when missing,
like vlm.loading. Profiles that name `towers` (`mini-scenes`) load towers trained once
against their model's vision tower (pruning.towers, which also holds `load_encoders`, the
rule that picks among the three). Other profiles without hub ids, and random-weight runs,
build seeded random towers of the same classes; the random text tower reads the decoder's
own tokenizer.
"""

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from transformers import (
    AutoTokenizer,
    BitImageProcessorPil,
    CLIPTextConfig,
    CLIPTextModel,
    Dinov2Config,
    Dinov2Model,
    PreTrainedTokenizerBase,
)
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from pruning.profiles import PruningProfile
from vlm.loading import (
    HFImagePreprocessor,
    ImagePreprocessor,
    resolve_checkpoint,
    unavailable,
)

# Values per parameter that enter the fingerprint: enough to tell checkpoints apart, cheap at 7B size.
FINGERPRINT_VALUES_PER_TENSOR = 64


def dino_image_preprocessor(image_size: int) -> HFImagePreprocessor:
    """DINOv2's ImageNet normalisation, resized and centre-cropped like CLIP's input.

    DINOv2's own processor crops 224 out of 256, which would make its grid cover less
    of the image than CLIP's; resizing the short side straight to `image_size` keeps
    both grids over the same square, so the upsampled sensitivity map lines up.
    """
    return HFImagePreprocessor(
        BitImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            image_mean=IMAGENET_DEFAULT_MEAN,
            image_std=IMAGENET_DEFAULT_STD,
        )
    )


def clip_text_config(
    profile: PruningProfile, *, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> CLIPTextConfig:
    return CLIPTextConfig(
        **profile.text,
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def dino_config(profile: PruningProfile) -> Dinov2Config:
    return Dinov2Config(**profile.dino)


class RelevanceReadout(nn.Module):
    """A pretrained question-patch pair of QPriv-VL's shapes: Wq0 (Dt -> P) and Wk0 (Dv -> P),
    bias-free, scoring σ(qᵀWq0ᵀWk0·K/√P) as QPrivVL.relevance does (pruning.towers trains it
    with the text tower; what CLIP's contrastive training gives the paper's towers)."""

    def __init__(self, profile: PruningProfile) -> None:
        super().__init__()
        self.projection_dim = profile.projection_dim
        self.query_projection = nn.Linear(profile.text_hidden_size, profile.projection_dim, bias=False)
        self.key_projection = nn.Linear(profile.vision_hidden_size, profile.projection_dim, bias=False)

    def forward(self, vision_patches: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """Relevance logits [B, N] of CLIP patches [B, N, Dv] for question vectors [B, Dt]."""
        query, keys = self.query_projection(question), self.key_projection(vision_patches)
        return torch.einsum("bp,bnp->bn", query, keys) / self.projection_dim**0.5


def question_token_ids(
    tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (each question as <bos> words <eos>, truncated to `max_length`, padded)
    and each row's length [B]."""
    rows = []
    for question in questions:
        words = tokenizer(question, add_special_tokens=False)["input_ids"][: max_length - 2]
        rows.append([tokenizer.bos_token_id, *words, tokenizer.eos_token_id])
    lengths = torch.tensor([len(row) for row in rows])
    input_ids = torch.full((len(rows), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
    return input_ids, lengths


def pooled_question(text_model: CLIPTextModel, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, Dt]: the final-layer state at each row's end-of-text token (gradients flow when enabled)."""
    device = next(text_model.parameters()).device
    attention_mask = torch.arange(input_ids.shape[1]) < lengths[:, None]
    hidden = text_model(input_ids=input_ids.to(device), attention_mask=attention_mask.long().to(device)).last_hidden_state
    # The end-of-text state, located by construction rather than by the config's
    # eos_token_id (whose legacy value 2 makes CLIP pool at the largest token id).
    return hidden[torch.arange(len(lengths), device=device), (lengths - 1).to(device)]


class FrozenEncoders(nn.Module):
    """Question -> [Dt] vector and image -> [Nd, Dd] DINO patch features, without gradients.

    `fingerprint` identifies the exact encoders (tokenizer vocabulary, weights, DINO
    input size): cached inputs and trained artefacts record it, so features made by
    one pair of encoders are never read as if another had made them. Trained towers
    (pruning.towers) also carry their `relevance_readout` (part of the weights, so of the
    fingerprint) and `vision_digest`, the digest of the vision tower they were aligned to.
    """

    def __init__(
        self,
        profile: PruningProfile,
        text_model: CLIPTextModel,
        tokenizer: PreTrainedTokenizerBase,
        dino: Dinov2Model,
        preprocess_images: ImagePreprocessor,
        *,
        relevance_readout: RelevanceReadout | None = None,
        vision_digest: str | None = None,
    ) -> None:
        super().__init__()
        for name, size, expected in (
            ("CLIP text hidden size", text_model.config.hidden_size, profile.text_hidden_size),
            ("DINOv2 hidden size", dino.config.hidden_size, profile.dino_hidden_size),
            ("DINOv2 patch size", dino.config.patch_size, profile.dino["patch_size"]),
        ):
            if size != expected:
                raise ValueError(f"{name} is {size}, but pruning profile {profile.name!r} expects {expected}")
        self.profile = profile
        self.text_model = text_model.eval().requires_grad_(False)
        self.dino = dino.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.preprocess_images = preprocess_images
        self.relevance_readout = None if relevance_readout is None else relevance_readout.eval().requires_grad_(False)
        self.vision_digest = vision_digest
        self.fingerprint = self._fingerprint()

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    @torch.no_grad()
    def encode_questions(self, questions: Sequence[str]) -> torch.Tensor:
        """[B, Dt]: each question as <bos> words <eos>, truncated to the tower's positions."""
        input_ids, lengths = question_token_ids(
            self.tokenizer, questions, self.text_model.config.max_position_embeddings
        )
        return pooled_question(self.text_model, input_ids, lengths)

    @torch.no_grad()
    def encode_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """[B, Nd, Dd]: DINOv2's last-layer patch tokens, row-major on its grid (CLS and registers dropped)."""
        pixel_values = self.preprocess_images(images).to(self._device())
        hidden = self.dino(pixel_values=pixel_values).last_hidden_state
        return hidden[:, -self.profile.dino_grid**2 :]

    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(json.dumps([self.profile.name, self.profile.dino_image_size]).encode())
        digest.update(json.dumps(sorted(self.tokenizer.get_vocab().items())).encode())
        update_with_weights(digest, self)
        return digest.hexdigest()[:16]


def update_with_weights(digest: "hashlib._Hash", module: nn.Module) -> None:
    """Feed `digest` every state tensor's name, shape and first values: enough to tell
    checkpoints apart (any model, not only these encoders), cheap at 7B size."""
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1)[:FINGERPRINT_VALUES_PER_TENSOR].float().cpu().numpy().tobytes())


def build_random_encoders(
    profile: PruningProfile, tokenizer: PreTrainedTokenizerBase, *, seed: int | None = None
) -> FrozenEncoders:
    """Seeded random towers of the profile's sizes over `tokenizer`'s vocabulary (default seed: the profile's)."""
    text_config = clip_text_config(
        profile,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(profile.encoder_seed if seed is None else seed)
        text_model = CLIPTextModel(text_config)
        dino = Dinov2Model(dino_config(profile))
    return FrozenEncoders(profile, text_model, tokenizer, dino, dino_image_preprocessor(profile.dino_image_size))


def _text_owner(profile: PruningProfile) -> str:
    return f"the CLIP text tower of pruning profile {profile.name!r}"


def _dino_owner(profile: PruningProfile) -> str:
    return f"DINOv2 of pruning profile {profile.name!r}"


def encoder_checkpoints(
    profile: PruningProfile,
    *,
    text_source: str | Path | None = None,
    dino_source: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[Path, Path]:
    """The local CLIP text and DINOv2 checkpoint folders, found without loading anything;
    ModelNotAvailableError in milliseconds when one is absent (vlm.loading.resolve_checkpoint)."""
    return (
        resolve_checkpoint(_text_owner(profile), profile.text_hf_id, text_source, cache_dir, "pruning.text_source"),
        resolve_checkpoint(_dino_owner(profile), profile.dino_hf_id, dino_source, cache_dir, "pruning.dino_source"),
    )


def load_pretrained_encoders(
    profile: PruningProfile,
    *,
    text_source: str | Path | None = None,
    dino_source: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> FrozenEncoders:
    """Real CLIP text tower (+ its tokenizer) and DINOv2 from local folders or the local HF cache."""
    text_path, dino_path = encoder_checkpoints(
        profile, text_source=text_source, dino_source=dino_source, cache_dir=cache_dir
    )
    text_owner, dino_owner = _text_owner(profile), _dino_owner(profile)
    try:
        # A full CLIPModel checkpoint holds the text tower under the keys CLIPTextModel reads.
        text_model = CLIPTextModel.from_pretrained(text_path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(text_path, local_files_only=True)
    except OSError as error:
        raise unavailable(text_owner, profile.text_hf_id, f"loading {text_path} failed ({error})", "pruning.text_source") from error
    try:
        dino = Dinov2Model.from_pretrained(dino_path, local_files_only=True)
    except OSError as error:
        raise unavailable(dino_owner, profile.dino_hf_id, f"loading {dino_path} failed ({error})", "pruning.dino_source") from error
    return FrozenEncoders(profile, text_model, tokenizer, dino, dino_image_preprocessor(profile.dino_image_size))
