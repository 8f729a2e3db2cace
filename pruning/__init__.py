"""QPriv-VL: question-guided, privacy-aware visual-token pruning (Dynamic Threshold Predictor)."""
