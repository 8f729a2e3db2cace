"""The offline `mini` model: a laptop-sized LLaVA trained once on easy-VQA and cached.

Importing this package registers its loader, so `vlm.load_model("mini", stage=...)`
finds the built model (`stage="base"` before the VQA LoRA stage, `"vqa"` after); the
`mini-positional` and `mini-interleaved` profiles are the same model built with their own
recipes (recipe.RECIPES); `mini-scenes` is the scene testbed's (scene_stages.py), whose
weights ship with the code (build.SHIPPED_ROOT).
"""

from vlm.loading import register_loader
from vlm.mini.build import MiniFolder, build_mini, load_mini, weights_identity
from vlm.mini.recipe import RECIPES, MiniRecipe, SceneRecipe, recipe_for

for _profile in RECIPES:
    register_loader(_profile, load_mini)

__all__ = ["RECIPES", "MiniFolder", "MiniRecipe", "SceneRecipe", "build_mini", "load_mini", "recipe_for", "weights_identity"]
