"""Built-in dataset adapters; importing this package registers them."""

from vqa.adapters.easyvqa import EASYVQA
from vqa.adapters.easyvqa_stamped import EASYVQA_STAMPED
from vqa.adapters.scenes import SCENES, SCENES_STAMPED
from vqa.adapters.hub_tables import GQA, OKVQA, PATHVQA, VQA_RAD, VQAV2
from vqa.adapters.slake import SLAKE

__all__ = ["EASYVQA", "EASYVQA_STAMPED", "GQA", "OKVQA", "PATHVQA", "SCENES", "SCENES_STAMPED", "SLAKE", "VQAV2", "VQA_RAD"]
