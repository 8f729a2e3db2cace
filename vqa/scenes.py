"""Scenes: a generated CLEVR-like benchmark where each question needs specific objects.

easy-VQA asks about the one shape that fills its image, so any token answers and pruning
is free. Here a 64x64 image holds 2-6 objects (shape, colour, size) on a 4x4 grid of cells,
and each question needs some of them: an attribute by location ("What color is the shape in
the top left?"), a relation ("What shape is left of the red circle?"), existence ("Is there
a blue triangle?") or a count ("How many circles are there?"). Most of the image is
irrelevant to any one question, so which tokens are kept decides the answer.

Every sample carries `needed_boxes`, the pixel boxes the question needs (the queried
objects'; for a question about an empty quadrant, the quadrant), so a question-oracle keep
set exists (`needed_patches`). Questions the image cannot answer (a location with no shape
in it, a relation to an object that is not there) have one answer, `REFUSAL_ANSWER`.

The stamped variant burns a real handwritten digit (scikit-learn's `load_digits`, as
`vqa.stamping`) into a random free cell of a share of the images, never asked about, and
records its box; training and test images draw from disjoint handwriting.

Everything follows from a `SceneSpec` and the image's number: generation is seeded per
(spec seed, split, image), so any subset of a split renders the same pixels and questions.
Large objects fill their cell; small ones fill one quarter of it (one 8-px patch at 64 px).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from vqa.stamping import DIGIT_SIDE, Box, MarkRecord, digit_images, digit_pools, stamp

SHAPES = ("circle", "square", "triangle")
COLOR_RGB: Mapping[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "cyan": (40, 190, 200),
}
SIZES = ("small", "large")
BACKGROUND_RGB = (235, 235, 235)
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
# (row delta sign, column delta sign) a target must have relative to the reference.
RELATIONS: Mapping[str, tuple[int, int]] = {"left of": (0, -1), "right of": (0, 1), "above": (-1, 0), "below": (1, 0)}
REFUSAL_ANSWER = "unanswerable"
QUESTION_KINDS = ("location", "relation", "exist", "count", "unanswerable")
ATTRIBUTES = ("color", "shape", "size")
# Which handwriting pool stamps each split: the attacker's public `aux` split shares the
# training pool, so a probe is always tested on handwriting it never saw. `pretrain` is what
# the public base model is built on (as LLaVA's pretraining data, no client's and no
# attacker's), so that clients fine-tune and are attacked on rows the base never saw.
STAMP_POOLS = {"pretrain": "train", "train": "train", "aux": "train", "test": "test"}
SPLITS = tuple(STAMP_POOLS)


class SceneSpecError(ValueError):
    """A scene setting that cannot be generated; names the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"scene setting {key}={value!r} cannot be generated; allowed: {allowed}")


@dataclass(frozen=True)
class SceneSpec:
    """How a scene benchmark is generated.

    `images` is the number of images per split; `questions_per_image` questions are drawn
    per image (fewer when the scene cannot support that many distinct ones), and
    `unanswerable_share` of them ask what the image cannot answer. `stamp_share` of the
    images get a handwritten digit of `stamp_side` pixels in a free cell.
    """

    image_size: int = 64
    cells: int = 4
    min_objects: int = 2
    max_objects: int = 6
    shapes: tuple[str, ...] = SHAPES
    colors: tuple[str, ...] = tuple(COLOR_RGB)
    sizes: tuple[str, ...] = SIZES
    questions_per_image: int = 6
    unanswerable_share: float = 0.1
    stamp_share: float = 0.0
    stamp_side: int = 16
    # The evaluation split comes last (pruning/prepare.py reads it as the held-out split).
    images: tuple[tuple[str, int], ...] = (("pretrain", 20000), ("train", 3000), ("aux", 1000), ("test", 500))
    seed: int = 0
    kind_weights: tuple[tuple[str, float], ...] = (("location", 1.0), ("relation", 1.0), ("exist", 1.0), ("count", 1.0))

    def __post_init__(self) -> None:
        if self.cells < 2 or self.image_size % (2 * self.cells):
            raise SceneSpecError("cells", self.cells, f"an even split of image_size={self.image_size} into at least 2x2 cells")
        if self.cell_side < 8:
            raise SceneSpecError("image_size", self.image_size, f"at least 8 px per cell ({8 * self.cells} px for {self.cells} cells)")
        room = self.cells**2 - (1 if self.stamp_share > 0 else 0)
        if not 1 <= self.min_objects <= self.max_objects:
            raise SceneSpecError("min_objects", self.min_objects, f"1..max_objects={self.max_objects}")
        if self.max_objects > room:
            raise SceneSpecError(
                "max_objects", self.max_objects,
                f"at most {room} ({self.cells}x{self.cells} cells{', one kept free for the stamp' if room < self.cells**2 else ''})",
            )
        for key, values, known in (("shapes", self.shapes, SHAPES), ("colors", self.colors, tuple(COLOR_RGB)), ("sizes", self.sizes, SIZES)):
            unknown = [value for value in values if value not in known]
            if unknown or not values or len(set(values)) != len(values):
                raise SceneSpecError(key, values, f"distinct values among {', '.join(known)}")
        if not 0.0 <= self.stamp_share <= 1.0:
            raise SceneSpecError("stamp_share", self.stamp_share, "a share within [0, 1]")
        if self.stamp_side < DIGIT_SIDE or self.stamp_side % DIGIT_SIDE or self.stamp_side > self.cell_side:
            raise SceneSpecError(
                "stamp_side", self.stamp_side,
                f"a multiple of {DIGIT_SIDE} px (the digit's cells) no larger than a cell ({self.cell_side} px of a "
                f"{self.image_size} px image)",
            )
        if not 0.0 <= self.unanswerable_share < 1.0:
            raise SceneSpecError("unanswerable_share", self.unanswerable_share, "a share within [0, 1)")
        if self.questions_per_image < 1:
            raise SceneSpecError("questions_per_image", self.questions_per_image, "at least 1")
        for split, count in self.images:
            if split not in SPLITS or count < 1:
                raise SceneSpecError(f"images.{split}", count, f"a positive count for a split among {', '.join(SPLITS)}")
        for kind, weight in self.kind_weights:
            if kind not in QUESTION_KINDS[:-1] or weight < 0:
                raise SceneSpecError(f"kind_weights.{kind}", weight, f"a weight >= 0 for one of {', '.join(QUESTION_KINDS[:-1])}")

    @property
    def cell_side(self) -> int:
        return self.image_size // self.cells

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(split for split, _ in self.images)

    def image_count(self, split: str) -> int:
        return dict(self.images)[split]


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    size: str
    row: int
    col: int
    box: Box

    def describe(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class SceneQuestion:
    question: str
    answer: str
    kind: str
    needed_boxes: tuple[Box, ...]


@dataclass(frozen=True)
class Scene:
    """One generated image: its objects, its mark (None when plain) and its questions."""

    split: str
    number: int
    spec: SceneSpec = field(repr=False)
    objects: tuple[SceneObject, ...]
    mark: MarkRecord | None
    questions: tuple[SceneQuestion, ...]

    @property
    def image_id(self) -> str:
        return scene_image_id(self.spec, self.split, self.number)

    def render(self) -> Image.Image:
        return render_scene(self.spec, self.objects, self.mark)


def scene_image_id(spec: SceneSpec, split: str, number: int) -> str:
    # The spec's digest keeps two specs' images apart in any cache keyed by image id.
    return f"scenes-{spec_tag(spec)}/{split}/{number}"


@lru_cache(maxsize=32)
def spec_tag(spec: SceneSpec) -> str:
    return f"{zlib.crc32(repr(spec).encode()):08x}"


def _rng(spec: SceneSpec, split: str, number: int) -> np.random.Generator:
    # crc32, not hash(): Python salts str hashes per process.
    return np.random.default_rng([spec.seed, zlib.crc32(split.encode()), number])


def quadrant_of(obj: SceneObject, cells: int) -> str:
    half = cells // 2
    return QUADRANTS[2 * (obj.row >= half) + (obj.col >= half)]


def quadrant_box(spec: SceneSpec, quadrant: str) -> Box:
    half = spec.image_size // 2
    index = QUADRANTS.index(quadrant)
    left, top = half * (index % 2), half * (index // 2)
    return left, top, left + half, top + half


def _object_box(spec: SceneSpec, row: int, col: int, size: str, rng: np.random.Generator) -> Box:
    side = spec.cell_side
    left, top = col * side, row * side
    if size == "large":
        return left + 1, top + 1, left + side - 1, top + side - 1
    # Small: one quarter of the cell, in a random quarter, so it never straddles a half-cell line.
    half = side // 2
    left += half * int(rng.integers(2))
    top += half * int(rng.integers(2))
    return left + 1, top + 1, left + half - 1, top + half - 1


def render_scene(spec: SceneSpec, objects: Sequence[SceneObject], mark: MarkRecord | None) -> Image.Image:
    image = Image.new("RGB", (spec.image_size, spec.image_size), BACKGROUND_RGB)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        left, top, right, bottom = obj.box
        color = COLOR_RGB[obj.color]
        if obj.shape == "circle":
            draw.ellipse((left, top, right - 1, bottom - 1), fill=color)
        elif obj.shape == "square":
            draw.rectangle((left, top, right - 1, bottom - 1), fill=color)
        else:
            draw.polygon(((left + right - 1) / 2, top, right - 1, bottom - 1, left, bottom - 1), fill=color)
    return stamp(image, mark) if mark is not None else image


def related_objects(objects: Sequence[SceneObject], reference: SceneObject, relation: str) -> list[SceneObject]:
    """The objects standing `relation` ("left of", ...) the reference, by grid cell."""
    row_sign, col_sign = RELATIONS[relation]
    return [
        obj for obj in objects
        if obj is not reference
        and (row_sign == 0 or np.sign(obj.row - reference.row) == row_sign)
        and (col_sign == 0 or np.sign(obj.col - reference.col) == col_sign)
    ]


def _count_word(count: int) -> str:
    return str(count)


class _QuestionMaker:
    """Draws one scene's questions; each kind returns None when this scene cannot ask it."""

    def __init__(self, spec: SceneSpec, objects: Sequence[SceneObject], rng: np.random.Generator) -> None:
        self.spec, self.objects, self.rng = spec, list(objects), rng

    def pick(self, values: Sequence):
        return values[int(self.rng.integers(len(values)))]

    def _attribute_question(self, attribute: str, where: str) -> str:
        if attribute == "shape":
            return f"What shape is {where}?"
        return f"What {attribute} is the shape {where}?"

    def location(self) -> SceneQuestion | None:
        by_quadrant: dict[str, list[SceneObject]] = {}
        for obj in self.objects:
            by_quadrant.setdefault(quadrant_of(obj, self.spec.cells), []).append(obj)
        single = [q for q in QUADRANTS if len(by_quadrant.get(q, [])) == 1]
        if not single:
            return None
        quadrant = self.pick(single)
        obj = by_quadrant[quadrant][0]
        attribute = self.pick(ATTRIBUTES)
        return SceneQuestion(
            self._attribute_question(attribute, f"in the {quadrant}"), getattr(obj, attribute), "location", (obj.box,)
        )

    def _unique_references(self) -> list[SceneObject]:
        described = [obj.describe() for obj in self.objects]
        return [obj for obj in self.objects if described.count(obj.describe()) == 1]

    def _related(self, reference: SceneObject, relation: str) -> list[SceneObject]:
        return related_objects(self.objects, reference, relation)

    def relation(self) -> SceneQuestion | None:
        options = [
            (reference, relation, related[0])
            for reference in self._unique_references()
            for relation in RELATIONS
            if len(related := self._related(reference, relation)) == 1
        ]
        if not options:
            return None
        reference, relation, target = self.pick(options)
        attribute = self.pick(("color", "shape"))
        question = self._attribute_question(attribute, f"{relation} the {reference.describe()}")
        return SceneQuestion(question, getattr(target, attribute), "relation", (reference.box, target.box))

    def exist(self) -> SceneQuestion | None:
        present = {(obj.color, obj.shape) for obj in self.objects}
        absent = [(c, s) for c in self.spec.colors for s in self.spec.shapes if (c, s) not in present]
        if self.rng.random() < 0.5 or not absent:
            color, shape = self.pick(sorted(present))
            answer = "yes"
            needed = [obj for obj in self.objects if (obj.color, obj.shape) == (color, shape)]
        else:
            color, shape = self.pick(absent)
            answer = "no"
            # What must be looked at to say no: the objects that share the colour or the shape.
            needed = [obj for obj in self.objects if obj.color == color or obj.shape == shape]
        return SceneQuestion(f"Is there a {color} {shape}?", answer, "exist", tuple(obj.box for obj in needed))

    def count(self) -> SceneQuestion | None:
        attribute = self.pick(("color", "shape"))
        value = self.pick(self.spec.colors if attribute == "color" else self.spec.shapes)
        matching = [obj for obj in self.objects if getattr(obj, attribute) == value]
        question = f"How many {value} shapes are there?" if attribute == "color" else f"How many {value}s are there?"
        return SceneQuestion(question, _count_word(len(matching)), "count", tuple(obj.box for obj in matching))

    def unanswerable(self) -> SceneQuestion | None:
        occupied = {quadrant_of(obj, self.spec.cells) for obj in self.objects}
        empty = [q for q in QUADRANTS if q not in occupied]
        present = {obj.describe() for obj in self.objects}
        missing = [f"{c} {s}" for c in self.spec.colors for s in self.spec.shapes if f"{c} {s}" not in present]
        if empty and (not missing or self.rng.random() < 0.5):
            quadrant = self.pick(empty)
            attribute = self.pick(ATTRIBUTES)
            # An empty quadrant is known empty only by looking at all of it.
            return SceneQuestion(
                self._attribute_question(attribute, f"in the {quadrant}"), REFUSAL_ANSWER, "unanswerable",
                (quadrant_box(self.spec, quadrant),),
            )
        if not missing:
            return None
        color, shape = self.pick(missing).split(" ")
        attribute = self.pick(("color", "shape"))
        relation = self.pick(list(RELATIONS))
        needed = [obj for obj in self.objects if obj.color == color or obj.shape == shape]
        question = self._attribute_question(attribute, f"{relation} the {color} {shape}")
        return SceneQuestion(question, REFUSAL_ANSWER, "unanswerable", tuple(obj.box for obj in needed))


def _questions(spec: SceneSpec, objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[SceneQuestion, ...]:
    maker = _QuestionMaker(spec, objects, rng)
    kinds = [kind for kind, weight in spec.kind_weights if weight > 0]
    weights = np.array([weight for _, weight in spec.kind_weights if weight > 0], dtype=np.float64)
    chosen: dict[str, SceneQuestion] = {}
    for _ in range(4 * spec.questions_per_image):
        if len(chosen) == spec.questions_per_image:
            break
        if rng.random() < spec.unanswerable_share:
            made = maker.unanswerable()
        else:
            made = getattr(maker, kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))])()
        # One answer per question text within an image: a repeated question would be its own hint.
        if made is not None and made.question not in chosen:
            chosen[made.question] = made
    return tuple(chosen.values())


def _plan_stamps(spec: SceneSpec, split: str) -> dict[int, int]:
    """Stamped image number -> `load_digits` row, for `round(stamp_share * images)` images."""
    count = spec.image_count(split)
    rng = np.random.default_rng([spec.seed, zlib.crc32(f"stamps/{split}".encode())])
    stamped = sorted(int(n) for n in rng.choice(count, size=round(spec.stamp_share * count), replace=False))
    pool = digit_pools(spec.seed)[STAMP_POOLS[split]]
    passes = max(1, -(-len(stamped) // len(pool)))
    rows = np.concatenate([rng.permutation(pool) for _ in range(passes)])[: len(stamped)]
    return dict(zip(stamped, (int(row) for row in rows), strict=True))


@lru_cache(maxsize=16)
def _stamp_plan(spec: SceneSpec, split: str) -> dict[int, int]:
    return _plan_stamps(spec, split)


def generate_scene(spec: SceneSpec, split: str, number: int) -> Scene:
    """The scene `number` of `split`: the same objects, mark and questions on every call."""
    if split not in spec.splits:
        raise SceneSpecError("split", split, f"one of {', '.join(spec.splits)}")
    if not 0 <= number < spec.image_count(split):
        raise SceneSpecError(f"images.{split}", number, f"an image number below {spec.image_count(split)}")
    rng = _rng(spec, split, number)
    count = int(rng.integers(spec.min_objects, spec.max_objects + 1))
    cells = [int(c) for c in rng.permutation(spec.cells**2)]
    objects = []
    for cell in cells[:count]:
        row, col = divmod(cell, spec.cells)
        shape, color, size = (spec.shapes[int(rng.integers(len(spec.shapes)))],
                              spec.colors[int(rng.integers(len(spec.colors)))],
                              spec.sizes[int(rng.integers(len(spec.sizes)))])
        objects.append(SceneObject(shape, color, size, row, col, _object_box(spec, row, col, size, rng)))
    objects.sort(key=lambda obj: (obj.row, obj.col))
    mark = None
    digit_row = _stamp_plan(spec, split).get(number)
    if digit_row is not None:
        free = cells[count:]
        row, col = divmod(free[int(rng.integers(len(free)))], spec.cells)
        slack = spec.cell_side - spec.stamp_side
        left = col * spec.cell_side + int(rng.integers(slack + 1))
        top = row * spec.cell_side + int(rng.integers(slack + 1))
        images, labels = digit_images()
        mark = MarkRecord(
            image_id=scene_image_id(spec, split, number),
            split=split,
            digit=int(labels[digit_row]),
            digit_index=digit_row,
            position=f"{left},{top}",
            box=(left, top, left + spec.stamp_side, top + spec.stamp_side),
            ink=tuple(tuple(int(level) for level in r) for r in images[digit_row]),
            image_side=spec.image_size,
        )
    return Scene(split, number, spec, tuple(objects), mark, _questions(spec, objects, rng))


_QUADRANT = "|".join(QUADRANTS)
_RELATION = "|".join(RELATIONS)
_TEMPLATES = (
    ("location", re.compile(rf"^What (?:(?P<attribute>color|size) is the shape|(?P<shape>shape) is) in the (?P<quadrant>{_QUADRANT})\?$")),
    ("relation", re.compile(rf"^What (?:(?P<attribute>color) is the shape|(?P<shape>shape) is) (?P<relation>{_RELATION}) "
                            r"the (?P<color>\w+) (?P<kind>\w+)\?$")),
    ("exist", re.compile(r"^Is there a (?P<color>\w+) (?P<kind>\w+)\?$")),
    ("count", re.compile(r"^How many (?:(?P<color>\w+) shapes|(?P<kind>\w+)s) are there\?$")),
)


def answer_in_scene(scene: Scene, question: str) -> str | None:
    """What `scene` answers to a question of this benchmark's templates, asked of any image (the
    irrelevant-question probe pairs an image with another image's questions): REFUSAL_ANSWER where
    the quadrant is empty or the object referred to is absent; None where the question is not one
    of the templates or is ambiguous here (two shapes in the quadrant, two objects it could refer
    to or relate to, none related)."""
    for kind, template in _TEMPLATES:
        if (match := template.match(question)) is None:
            continue
        parts = match.groupdict()
        attribute = parts.get("attribute") or "shape"
        if kind == "location":
            inside = [obj for obj in scene.objects if quadrant_of(obj, scene.spec.cells) == parts["quadrant"]]
            if not inside:
                return REFUSAL_ANSWER
            return getattr(inside[0], attribute) if len(inside) == 1 else None
        if kind == "relation":
            references = [obj for obj in scene.objects if (obj.color, obj.shape) == (parts["color"], parts["kind"])]
            if not references:
                return REFUSAL_ANSWER
            related = related_objects(scene.objects, references[0], parts["relation"]) if len(references) == 1 else []
            return getattr(related[0], attribute) if len(related) == 1 else None
        if kind == "exist":
            present = any((obj.color, obj.shape) == (parts["color"], parts["kind"]) for obj in scene.objects)
            return "yes" if present else "no"
        if parts["color"] is not None:
            return _count_word(sum(obj.color == parts["color"] for obj in scene.objects))
        return _count_word(sum(obj.shape == parts["kind"] for obj in scene.objects))
    return None


def box_patches(box: Box, original: int, image_size: int, patch_size: int) -> tuple[int, ...]:
    """Row-major indices of the patches a pixel box of an `original`-side image overlaps, once the
    image is resized to `image_size` and cut into `patch_size` patches (exact, in integers)."""
    if patch_size < 1 or image_size < patch_size or image_size % patch_size:
        raise ValueError(f"image size {image_size} is not a whole number of {patch_size}-pixel patches")
    grid = image_size // patch_size
    left, top, right, bottom = box
    scale = patch_size * original
    rows = range(top * image_size // scale, -(-bottom * image_size // scale))
    cols = range(left * image_size // scale, -(-right * image_size // scale))
    return tuple(row * grid + col for row in rows for col in cols)


def needed_patches(boxes: Sequence[Box], original: int, image_size: int, patch_size: int) -> tuple[int, ...]:
    """The question-oracle keep set: every patch one of the needed boxes overlaps."""
    return tuple(sorted({p for box in boxes for p in box_patches(box, original, image_size, patch_size)}))
