"""One module per paper, each holding that paper's numbers and a `claims(results, ...)` that judges
them on loaded runs (analysis.stats): `qpriv_vl` (seed 000), `activation_inversion` (seed 001:
ActInv, PAF, PriPert), `vision_edge` (seed 002: SARA, the positionless edge), `dp_mtv` (seed 003).
Every claim's row has the paper's number, the estimate with its interval and n, the rule, the
verdict (holds, does not hold, inconclusive, not testable) and why."""
