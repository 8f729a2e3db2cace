"""Flower ServerApps and strategies for CL, FedAvg, sequential SL and two-cut USL, the adversarial variant and the wire."""
