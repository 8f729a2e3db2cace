"""The offline `mini` model: a laptop-sized LLaVA trained once on easy-VQA and cached.

Importing this package registers its loader, so `vlm.load_model("mini", stage=...)`
finds the built model (`stage="base"` before the VQA LoRA stage, `"vqa"` after).
"""

from vlm.loading import register_loader
from vlm.mini.build import MiniFolder, build_mini, load_mini
from vlm.mini.recipe import MiniRecipe

register_loader("mini", load_mini)

__all__ = ["MiniFolder", "MiniRecipe", "build_mini", "load_mini"]
