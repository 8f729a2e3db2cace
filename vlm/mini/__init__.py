"""The offline `mini` model: a laptop-sized LLaVA trained once on easy-VQA and cached.

Importing this package registers its loader, so `vlm.load_model("mini", stage=...)`
finds the built model (`stage="base"` before the VQA LoRA stage, `"vqa"` after); the
`mini-positional` and `mini-interleaved` profiles are the same model built with their own
recipes (recipe.RECIPES).
"""

from vlm.loading import register_loader
from vlm.mini.build import MiniFolder, build_mini, load_mini
from vlm.mini.recipe import RECIPES, MiniRecipe, recipe_for

for _profile in RECIPES:
    register_loader(_profile, load_mini)

__all__ = ["RECIPES", "MiniFolder", "MiniRecipe", "build_mini", "load_mini", "recipe_for"]
