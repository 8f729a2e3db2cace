"""Flower ClientApps: one role per paradigm, the client-side model and its private state."""

import sys
from pathlib import Path

# Deployment's per-message process (flwr's supernode runtime.run_clientapp pulls one message,
# replies and exits): its memory never reaches the next message.
ONE_MESSAGE_PER_PROCESS = Path(sys.argv[0]).name == "flwr-clientapp"
