"""The cut probe: a passive server reads the stamped digit straight from the rows a client sends at the first cut.

FORA and FSHA read the mark back from a reconstructed image, so a weak inverse network and a
mark that never crossed the cut look alike. This attacker skips the image: a linear probe
(scikit-learn's logistic regression on standardised rows) reads the digit from the visual rows.
Its `readout`:
- "rows" (default): the probe classifies each row (a digit, for the rows of the mark's box on the
  attacker's own images, or "no mark"), and a sample reads as the digit its most confident row
  gives. The mark sits in a few rows of 64, and a pooled summary drowns it: on the scene testbed's
  unpruned runs the pooled probe reads no more than a guess where this one reads most marks.
- "pooled": one vector per sample, its rows' mean and elementwise max (for a mark the front's
  attention has spread over every row).

What it knows (Kerckhoffs): the public model, whose front it runs on its own stamped
auxiliary images, and their digits (the public split's mark records, `vqa.mark_records`);
the run's pruning policy with its settings, built from the run's config as a client builds
it (`policy_aware`; with a trained policy, DTP, that includes the run's prepared artefacts),
so its auxiliary rows come from the keep sets the client's policy would choose; without the
run's config, random keep sets of the observed sizes. With `adaptive`, its rows also pass
through the run's edge and activation defenses (attacks.adaptive). It does not know the
client's private adapters: its front is the public one, not fitted to the observations.

Read-back is the probe's accuracy on the observed samples whose images carry a mark, beside
the most frequent digit's share among them (what a guess reads).
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from attacks.adaptive import AdaptiveAttack
from attacks.base import ACTIVATION, IMAGE, PASSIVE, AttackResult, Truth, register_attack
from attacks.observations import VisualObservation, VisualSpans, fewer_visual_rows, visual_observations
from attacks.marks import public_marks
from attacks.recording import Recording
from vqa import VQASample
from vqa.scenes import box_patches
from vqa.stamping import MarkRecord


ROWS, POOLED = "rows", "pooled"
# The label of a row outside the mark's box when the probe reads rows.
NO_MARK = -1


@dataclass
class CutProbeOptions:
    # At most this many stamped auxiliary images train the probe.
    max_aux: int = 2000
    # scikit-learn's C: the inverse strength of the probe's L2 regularisation.
    regularisation: float = 1.0
    # "rows": a digit-or-no-mark probe on each row, the most confident row read; "pooled": a digit
    # probe on each sample's mean and max row.
    readout: str = ROWS
    # Auxiliary keep sets from the run's own pruning policy (False: random ones of the observed sizes).
    policy_aware: bool = True
    # Also pass the auxiliary rows through the run's edge and activation defenses.
    adaptive: bool = False
    seed: int = 0
    # Images per forward pass of the attacker's front.
    batch_size: int = 64
    progress: bool = True


def pooled(rows: Sequence[torch.Tensor]) -> np.ndarray:
    """Each sample's visual rows [k_b, D] -> [mean, max] over its rows, [n, 2D]."""
    return np.stack([torch.cat([r.float().mean(0), r.float().amax(0)]).cpu().numpy() for r in rows])


class CutProbe(AdaptiveAttack):
    name = "cut_probe"
    threat_model = PASSIVE
    kind = IMAGE
    reads = (ACTIVATION,)
    headline = ("mark_readback",)
    Options = CutProbeOptions

    def fit(self, aux: Sequence[VQASample]) -> "CutProbe":
        """Keeps the stamped auxiliary images, their digits and their frozen vision features."""
        k, o = self.knowledge, self.options
        if o.readout not in (ROWS, POOLED):
            raise ValueError(f"readout={o.readout!r}; allowed: {(ROWS, POOLED)}")
        marked = [(sample, mark) for sample, mark in zip(aux, public_marks(aux), strict=True) if mark is not None]
        marked = marked[: o.max_aux]
        digits = {mark.digit for _, mark in marked}
        if len(digits) < 2:
            raise ValueError(f"cut_probe trains on stamped auxiliary images with at least two digits; {len(marked)} of "
                             f"the {len(aux)} auxiliary samples carry a mark ({sorted(digits)}): give it a stamped "
                             "dataset's split (threat.aux_split of a *-stamped dataset)")
        self.aux = [sample for sample, _ in marked]
        self.aux_digits = np.array([mark.digit for _, mark in marked])
        # The patches of each mark's box (every row there holds part of the digit).
        self.aux_boxes = [set(box_patches(mark.box, mark.image_side, k.image_size, k.patch_size)) for _, mark in marked]
        self.aux_features = k.features(k.pixel_values(self.aux))
        return self

    def _aux_keep(self, counts: Sequence[int]) -> tuple[list[torch.Tensor], torch.Tensor, str]:
        """The auxiliary images' keep sets, the features their rows are read from, and where the
        sets came from."""
        k, o = self.knowledge, self.options
        view = self.policy_view(self.aux, self.aux_features) if o.policy_aware else None
        if view is not None:
            return view.keep, view.features, f"the run's policy ({self.run_config.pruning.policy})"
        generator = torch.Generator().manual_seed(o.seed)
        chosen = torch.randint(len(counts), (len(self.aux),), generator=generator)
        keep = [torch.randperm(k.num_patches, generator=generator)[: counts[int(i)]].sort().values for i in chosen]
        return keep, self.aux_features, "random, of the observed sizes"

    @torch.no_grad()
    def probe(self, counts: Sequence[int]) -> tuple[object, str]:
        """The probe, trained on the attacker's own rows for its stamped auxiliary images: per row
        (its digit inside the mark's box, NO_MARK outside) or per sample (`readout`)."""
        if not hasattr(self, "aux_features"):
            raise RuntimeError("CutProbe.fit(aux) must run before the probe is trained")
        keep, features, source = self._aux_keep(counts)
        step = max(1, self.options.batch_size)
        rows, sent = [], []
        for start in range(0, len(self.aux), step):
            chunk_rows, chunk_sent = self.attacker_rows(self.knowledge.model, features[start : start + step],
                                                        self.aux[start : start + step], keep[start : start + step])
            rows.extend(chunk_rows)
            sent.extend(chunk_sent)
        classifier = make_pipeline(StandardScaler(), LogisticRegression(C=self.options.regularisation, max_iter=2000))
        if self.options.readout == POOLED:
            return classifier.fit(pooled(rows), self.aux_digits), source
        labels = np.concatenate([np.where(np.isin(positions.cpu().numpy(), list(box)), digit, NO_MARK)
                                 for positions, box, digit in zip(sent, self.aux_boxes, self.aux_digits, strict=True)])
        if (labels == NO_MARK).all():
            # The policy sends no row of any mark's box: the probe has nothing to learn a digit from.
            return None, f"{source}; no row sent from a mark's box, so it guesses the commonest digit"
        return classifier.fit(torch.cat(rows).float().cpu().numpy(), labels), source

    def read(self, classifier, rows: Sequence[torch.Tensor]) -> np.ndarray:
        """Each observed sample's digit: the pooled probe's, or the digit its most confident row gives."""
        if classifier is None:
            return np.full(len(rows), Counter(self.aux_digits.tolist()).most_common(1)[0][0])
        if self.options.readout == POOLED:
            return classifier.predict(pooled(rows))
        digits = classifier.classes_ != NO_MARK
        predicted = []
        for sample_rows in rows:
            confidence = classifier.predict_proba(sample_rows.float().cpu().numpy())[:, digits]
            predicted.append(classifier.classes_[digits][int(confidence.max(0).argmax())])
        return np.array(predicted)

    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k = self.knowledge
        self.resolve_defenses(recording)
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if fewer_visual_rows(recording.config) else None
        observations = visual_observations(recording, k, attack=self.name, spans=spans)
        classifier, source = self.probe([obs.rows.shape[0] for obs in observations])
        predicted = self.read(classifier, [obs.rows for obs in observations])
        result = AttackResult(
            self.name,
            details={"observed_samples": len(observations), "aux_images": len(self.aux),
                     "aux_keep_sets": source, "adaptive_to": self.adapted_to},
            outputs={"predicted_digits": torch.as_tensor(predicted)},
        )
        if truth is not None:
            result.metrics.update(readback(observations, predicted, truth))
        return result


def readback(observations: Sequence[VisualObservation], predicted: np.ndarray, truth: Truth) -> dict[str, float]:
    """The probe's accuracy on the observed samples the truth knows to carry a mark, and a guess's."""
    digits, guesses = [], []
    known: dict[int, list[VQASample] | None] = {}
    for observation, guess in zip(observations, predicted, strict=True):
        seq = observation.entry.seq
        if seq not in known:
            known[seq] = truth.samples(observation.entry)
        samples = known[seq]
        mark = None if samples is None else truth.mark(samples[observation.index])
        if mark is not None:
            digits.append(mark.digit)
            guesses.append(int(guess))
    if not digits:
        return {"marked_samples": 0.0}
    return {
        "mark_readback": float(np.mean(np.array(guesses) == np.array(digits))),
        "mark_readback_chance": Counter(digits).most_common(1)[0][1] / len(digits),
        "marked_samples": float(len(digits)),
    }


register_attack(CutProbe)
