"""Sequential SL client: owns everything in front of the cut; labels go to the server.

Besides the packed activation it sends each sample's answer tokens (the labels of
SL's server-side loss); the server rebuilds the label rows from them because, with
left padding, a sample's answer is always its last tokens.
"""

from collections.abc import Sequence

import torch

from clients.split import SplitClient
from training import protocol
from training.batches import EncodedSample


class SLClient(SplitClient):
    front = "client"

    def extra_forward_tensors(self, batch: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
        return {
            protocol.ANSWERS: torch.cat([item.answer_ids for item in batch]),
            protocol.ANSWER_LENGTHS: torch.tensor([item.answer_ids.numel() for item in batch]),
        }
