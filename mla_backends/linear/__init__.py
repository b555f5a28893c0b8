"""Linear-attention layers (Gated DeltaNet, KDA) for hybrid models: reference recurrence,
per-request state pool, and the backend the hybrid router sends linear layers to."""
