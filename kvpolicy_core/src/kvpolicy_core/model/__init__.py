"""Real models: the GGUF -> mlx-lm converter, the embedded default model, the default corpus."""
