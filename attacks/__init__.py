"""Attacks on what the server observed: FSHA, FORA, iDLG, MIA, ActInv, SARA, behind one interface and a registry."""
