"""The server's threat models: what the run config's `threat.model` names.

Which paradigms a threat model applies to follows from what it does: a server that records
needs a wire to record from, one that hijacks needs a cut to hijack through (vlm.paradigms).
"""

from dataclasses import dataclass

from registry import Registry
from vlm.paradigms import Paradigm


@dataclass(frozen=True)
class ThreatModel:
    name: str
    # Whether the server records what it receives, and what it sends that attacks replay, into <run>/recording/.
    records: bool = False
    # Whether it replaces its own segment with FSHA's networks and returns their gradient at the first cut.
    hijacks: bool = False

    def applies_to(self, paradigm: Paradigm) -> bool:
        if self.hijacks:
            return paradigm.split
        return paradigm.wire or not self.records


THREAT_MODELS: Registry[ThreatModel] = Registry("threat model")

# An honest server.
HONEST = THREAT_MODELS.register(ThreatModel("none"))
# Honest-but-curious: it records what it receives.
PASSIVE = THREAT_MODELS.register(ThreatModel("passive", records=True))
# Malicious: it hijacks the client's front with FSHA (strategies.adversarial), and records.
THREAT_MODELS.register(ThreatModel("active-fsha", records=True, hijacks=True))
