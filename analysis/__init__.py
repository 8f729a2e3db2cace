"""From run folders to evidence: loading runs (`runs`), tables (`tables`), the statistics every
verdict uses (`stats`), one module of claims per paper (`claims`), figures (`figures`), and the
provenance every result records (`provenance`). Benchmarks measure and call it; the results
notebook draws from it."""
